//! Running one child process the way every part of orch needs it: in its own process group,
//! with a wall-clock timeout, an early stop, bounded capture of stdout and stderr, and no way to
//! leave a process behind.
//!
//! The child never holds a pipe to orch: stdin is a temporary file holding the input, stdout
//! and stderr are unlinked temporary files the run tails ([`crate::spool`]). A child that
//! outlives a killed orch therefore never dies of SIGPIPE half-way through its work (the next
//! incarnation stops it, see [`crate::records`]), and a child can never block on a full pipe.
//! The captured stderr stays with the result for error messages.
//!
//! Lifecycle of [`run`]: spawn as the leader of a new process group → wait for the first of
//! (leader exits, timeout, cancellation) → on timeout/cancel SIGTERM the whole group, wait
//! `kill_grace`, SIGKILL what is left → in every case stop and reap whatever the leader left in
//! its group → collect the output tails. Dropping the future does the same termination in a
//! background task.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::group;
use crate::sandbox::{self, Prepared, Sandbox};
use crate::spool::{self, Spool};
use crate::supervise::Supervision;

/// Default wall-clock limit of a [`Cmd`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Default time between SIGTERM and SIGKILL when a [`Cmd`] is stopped.
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(5);
/// Default number of bytes kept from the end of stdout, and separately of stderr.
pub const DEFAULT_OUTPUT_LIMIT: usize = 256 * 1024;

/// How often a running child's output files are read.
const TAIL_EVERY: Duration = Duration::from_millis(50);
/// Bytes read from one output file per tick (the rest is read on the next one).
const TAIL_BUDGET: usize = 4 * 1024 * 1024;
/// Bytes read from one output file after the group ended, at most.
const FINAL_READ_LIMIT: usize = 64 * 1024 * 1024;

/// What to run and under which limits. Build with [`Cmd::new`] and the chained setters, or set
/// the public fields directly.
#[derive(Debug, Clone)]
pub struct Cmd {
    /// The program: a path, or a bare name looked up in `PATH`.
    pub program: PathBuf,
    /// Arguments, without the program.
    pub args: Vec<OsString>,
    /// Working directory; `None` inherits orch's.
    pub cwd: Option<PathBuf>,
    /// Variables added to (or overriding) the environment, applied last.
    pub env: Vec<(OsString, OsString)>,
    /// Variables removed from the inherited environment.
    pub env_remove: Vec<OsString>,
    /// Start from an empty environment instead of orch's (then `env` is all the child gets).
    pub env_clear: bool,
    /// Bytes written to the child's stdin, which is then closed; `None` gives it `/dev/null`.
    pub stdin: Option<Vec<u8>>,
    /// Wall-clock limit from spawn; past it the group is stopped and the run is `TimedOut`.
    pub timeout: Duration,
    /// Time between SIGTERM and SIGKILL when the group is stopped.
    pub kill_grace: Duration,
    /// Bytes kept from the end of stdout and, separately, of stderr.
    pub output_limit: usize,
    /// Stops the run early (the run ends as `Cancelled`) when this token is cancelled.
    pub cancel: Option<CancellationToken>,
    /// The run has no business leaving daemons behind (an agent): if orch dies while it runs,
    /// the next orch on this node also kills its descendants that left the group (`setsid`).
    /// Off for commands whose job is to start a service (deploys, staging): their daemons are
    /// what they were run for.
    pub no_daemons: bool,
    /// How much lower than orch's own the CPU priority of the run (and all it starts) is: a
    /// `nice` increment, 0 keeps orch's. See [`Cmd::batch`].
    pub nice: i32,
    /// Start from an empty environment and inherit only these variables of orch's (besides
    /// [`crate::env::BASE`]); `None` inherits orch's whole environment. See [`Cmd::env_allow`].
    pub allow_env: Option<Vec<String>>,
    /// Run inside this sandbox ([`crate::sandbox`]); `None` runs on the host.
    pub sandbox: Option<Arc<Sandbox>>,
    /// Run under a supervisor that outlives orch, recorded under this key
    /// ([`crate::supervise`]); `None` (or supervision not enabled) runs it directly.
    pub supervised: Option<String>,
    /// Gets every byte of stdout as it is read, while the child runs (an agent's transcript
    /// is written from it); `None` keeps only the bounded tail.
    pub stdout_sink: Option<OutputSink>,
}

/// A receiver of a child's output while it runs: called from orch's reading task with each
/// chunk read, in order. It must not block for long (the run's reading waits for it).
#[derive(Clone)]
pub struct OutputSink(pub Arc<SinkFn>);

/// What an [`OutputSink`] calls with each chunk.
pub type SinkFn = dyn Fn(&[u8]) + Send + Sync;

impl fmt::Debug for OutputSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OutputSink")
    }
}

/// The priority increment of batch children ([`Cmd::batch`]).
pub const BATCH_NICE: i32 = 10;

impl Cmd {
    /// A command with no arguments and the default limits.
    pub fn new(program: impl Into<PathBuf>) -> Cmd {
        Cmd {
            program: program.into(),
            args: Vec::new(),
            cwd: None,
            env: Vec::new(),
            env_remove: Vec::new(),
            env_clear: false,
            stdin: None,
            timeout: DEFAULT_TIMEOUT,
            kill_grace: DEFAULT_KILL_GRACE,
            output_limit: DEFAULT_OUTPUT_LIMIT,
            cancel: None,
            no_daemons: false,
            nice: 0,
            allow_env: None,
            sandbox: None,
            supervised: None,
            stdout_sink: None,
        }
    }

    /// Hands every chunk of stdout to `sink` as it is read (see [`OutputSink`]).
    pub fn stdout_sink(mut self, sink: OutputSink) -> Cmd {
        self.stdout_sink = Some(sink);
        self
    }

    /// Starts the child from an empty environment with only the variables of orch's that
    /// [`crate::env::allowed`] lets through for `extra` (plus [`Cmd::env`] variables).
    pub fn env_allow<I, S>(mut self, extra: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.allow_env
            .get_or_insert_with(Vec::new)
            .extend(extra.into_iter().map(Into::into));
        self
    }

    /// Runs the command inside `sandbox`.
    pub fn sandbox(mut self, sandbox: Arc<Sandbox>) -> Cmd {
        self.sandbox = Some(sandbox);
        self
    }

    /// Appends one argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Cmd {
        self.args.push(arg.into());
        self
    }

    /// Appends arguments.
    pub fn args<I, S>(mut self, args: I) -> Cmd
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets the working directory.
    pub fn cwd(mut self, dir: impl Into<PathBuf>) -> Cmd {
        self.cwd = Some(dir.into());
        self
    }

    /// Adds one environment variable.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Cmd {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Removes one inherited environment variable.
    pub fn env_remove(mut self, key: impl Into<OsString>) -> Cmd {
        self.env_remove.push(key.into());
        self
    }

    /// Starts the child with an empty environment (plus [`Cmd::env`] variables).
    pub fn env_clear(mut self) -> Cmd {
        self.env_clear = true;
        self
    }

    /// Feeds `bytes` to the child's stdin.
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Cmd {
        self.stdin = Some(bytes.into());
        self
    }

    /// Sets the wall-clock limit.
    pub fn timeout(mut self, timeout: Duration) -> Cmd {
        self.timeout = timeout;
        self
    }

    /// Sets the time between SIGTERM and SIGKILL.
    pub fn kill_grace(mut self, grace: Duration) -> Cmd {
        self.kill_grace = grace;
        self
    }

    /// Sets how many bytes of stdout and of stderr are kept.
    pub fn output_limit(mut self, bytes: usize) -> Cmd {
        self.output_limit = bytes;
        self
    }

    /// Marks the run as one that must leave no daemon behind (see [`Cmd::no_daemons`]).
    pub fn no_daemons(mut self) -> Cmd {
        self.no_daemons = true;
        self
    }

    /// Runs the command below orch's CPU priority ([`BATCH_NICE`] lower): for the long,
    /// CPU-hungry children that do the work (agents, test runs), so that when they
    /// fill every core, orch's own short steps between them (the git of a stage, the queue, the
    /// dashboard) still get a CPU at once instead of waiting behind them. When the machine has
    /// a free core it changes nothing. `orch-bench items`: with 200 items in flight, orch's own
    /// time per stage visit rose to a p95 several times its p50 while 200 test runs shared two
    /// cores.
    pub fn batch(mut self) -> Cmd {
        self.nice = BATCH_NICE;
        self
    }

    /// Runs the command under a supervisor recorded as `key` (see [`crate::supervise`]): a
    /// restarted orch adopts it instead of running it again.
    pub fn supervised(mut self, key: impl Into<String>) -> Cmd {
        self.supervised = Some(key.into());
        self
    }

    /// Stops the run when `token` is cancelled.
    pub fn cancel_on(mut self, token: CancellationToken) -> Cmd {
        self.cancel = Some(token);
        self
    }
}

/// Starts the child at orch's own CPU priority plus `increment` (at most 19), set in the child
/// before it runs the program, so it and everything it starts (which inherit it) run below
/// orch from their first instruction. Should the child be refused the change (it never is: a
/// process may always lower its own priority), it keeps orch's priority.
fn lower_priority(command: &mut Command, increment: i32) {
    // SAFETY: getpriority takes plain integers and touches no memory of ours. (A result of -1
    // may be an error; the child is then started at 9, still below orch's usual 0.)
    let own = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let target = own.saturating_add(increment).clamp(-20, 19);
    // SAFETY: the closure runs in the forked child before exec and only makes one
    // async-signal-safe system call with plain integers; its result is ignored on purpose
    // (a failure leaves the child at orch's priority, which is how it ran before).
    unsafe {
        command.pre_exec(move || {
            libc::setpriority(libc::PRIO_PROCESS, 0, target);
            Ok(())
        });
    }
}

/// Sets up the sandbox of `cmd`: its relays, its cgroup and bwrap's command line. A program
/// that is not there, or not executable, is the same error as without a sandbox (found on the
/// host, where bwrap would only say it failed).
async fn prepare_sandbox(cmd: &Cmd, sb: &Sandbox, run_id: u64) -> Result<Prepared, SpawnError> {
    let path_env = cmd
        .env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var_os("PATH"));
    let program = || cmd.program.display().to_string();
    let named = cmd.program.components().count() > 1 || cmd.program.is_absolute();
    // A relative path names a file in the run's working directory.
    let as_found = match (&cmd.cwd, named && cmd.program.is_relative()) {
        (Some(dir), true) => dir.join(&cmd.program),
        _ => cmd.program.clone(),
    };
    match sandbox::which(&as_found, path_env.as_deref()) {
        Some(found) => {
            use std::os::unix::fs::PermissionsExt as _;
            let executable = std::fs::metadata(&found)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
            if !executable {
                return Err(SpawnError::PermissionDenied { program: program() });
            }
        }
        None if named && as_found.is_dir() => {
            return Err(SpawnError::PermissionDenied { program: program() });
        }
        None => return Err(SpawnError::NotFound { program: program() }),
    }
    Prepared::new(
        sb,
        &cmd.program,
        &cmd.args,
        cmd.cwd.as_deref(),
        path_env.as_deref(),
        run_id,
    )
    .await
    .map_err(|e| SpawnError::Sandbox {
        program: cmd.program.display().to_string(),
        reason: e.to_string(),
    })
}

/// Before bwrap runs: the child joins the run's cgroup and takes the run's rlimits, so the
/// sandbox and everything in it start limited.
fn confine(command: &mut Command, prepared: &Prepared, limits: &sandbox::Limits) {
    let procs: Vec<std::ffi::CString> = prepared
        .cgroup
        .as_ref()
        .map(|c| c.procs.clone())
        .unwrap_or_default();
    let rlimits = sandbox::rlimits(limits);
    // SAFETY: the closure runs in the forked child before exec and makes only async-signal-safe
    // system calls (open, write, close, setrlimit) on data prepared before the fork.
    unsafe {
        command.pre_exec(move || {
            for path in &procs {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if written != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (resource, value) in &rlimits {
                let lim = libc::rlimit {
                    rlim_cur: *value,
                    rlim_max: *value,
                };
                // Lowering a limit never fails for lack of privilege; a failure is reported.
                if libc::setrlimit(*resource, &lim) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Whether process `pid` is gone (no such process): for files named after the process that
/// made them. False when it exists or that cannot be told.
pub fn process_gone(pid: i32) -> bool {
    // SAFETY: signal 0 sends nothing; it only asks whether the process exists.
    pid > 0
        && unsafe { libc::kill(pid, 0) } != 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// The command line as a person would type it (lossy, for logs and reports).
impl fmt::Display for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.program.display())?;
        for arg in &self.args {
            let arg = arg.to_string_lossy();
            if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || c == '\'' || c == '"')
            {
                write!(f, " '{}'", arg.replace('\'', r"'\''"))?;
            } else {
                write!(f, " {arg}")?;
            }
        }
        Ok(())
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ExitKind {
    /// The program exited by itself with this code.
    Exited(i32),
    /// The program was killed by this signal (not by orch).
    Signaled(i32),
    /// orch stopped it at the timeout.
    TimedOut,
    /// orch stopped it because the run was cancelled.
    Cancelled,
}

impl fmt::Display for ExitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitKind::Exited(code) => write!(f, "exit code {code}"),
            ExitKind::Signaled(sig) => write!(f, "killed by signal {sig}"),
            ExitKind::TimedOut => f.write_str("timed out"),
            ExitKind::Cancelled => f.write_str("cancelled"),
        }
    }
}

/// The result of a run that started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// How it ended.
    pub status: ExitKind,
    /// The last `output_limit` bytes of stdout.
    pub stdout_tail: Vec<u8>,
    /// The last `output_limit` bytes of stderr.
    pub stderr_tail: Vec<u8>,
    /// All bytes the child wrote to stdout.
    pub stdout_bytes: u64,
    /// All bytes the child wrote to stderr.
    pub stderr_bytes: u64,
    /// Wall-clock time from spawn to the end of the run.
    pub duration: Duration,
    /// Whether it ran directly, under a supervisor, or was adopted from an earlier orch.
    pub supervision: Supervision,
}

impl Output {
    /// True when the program exited with code 0.
    pub fn success(&self) -> bool {
        self.status == ExitKind::Exited(0)
    }

    /// The captured stdout as text (invalid UTF-8 replaced).
    pub fn stdout_lossy(&self) -> String {
        String::from_utf8_lossy(&self.stdout_tail).into_owned()
    }

    /// The captured stderr as text (invalid UTF-8 replaced).
    pub fn stderr_lossy(&self) -> String {
        String::from_utf8_lossy(&self.stderr_tail).into_owned()
    }

    /// True when stdout was longer than the capture limit (the tail misses its beginning).
    pub fn stdout_truncated(&self) -> bool {
        self.stdout_bytes > self.stdout_tail.len() as u64
    }

    /// The last `n_lines` lines of the captured stdout followed by the captured stderr, for
    /// reports and error messages (where the reason for a failure usually is at the very end).
    pub fn tail_text(&self, n_lines: usize) -> String {
        let mut text = self.stdout_lossy();
        if !self.stderr_tail.is_empty() {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&self.stderr_lossy());
        }
        last_lines(&text, n_lines)
    }
}

/// The last `n` lines of `text`, without trailing blank lines.
pub(crate) fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Why a run could not start (or could not be supervised).
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The program does not exist (not in `PATH`, or no such file).
    #[error("cannot run '{program}': program not found (not on PATH or no such file)")]
    NotFound {
        /// The program as given.
        program: String,
    },
    /// The program exists but may not be executed (not executable, or a directory).
    #[error("cannot run '{program}': permission denied (is it an executable file?)")]
    PermissionDenied {
        /// The program as given.
        program: String,
    },
    /// The sandbox the program was to run in could not be set up.
    #[error("cannot run '{program}' in its sandbox: {reason}")]
    Sandbox {
        /// The program as given.
        program: String,
        /// Why, with what to do about it.
        reason: String,
    },
    /// Any other failure to start or supervise the program.
    #[error("cannot run '{program}': {source}")]
    Io {
        /// The program as given.
        program: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

impl SpawnError {
    fn from_io(program: &Path, source: io::Error) -> SpawnError {
        let program = program.display().to_string();
        match source.kind() {
            io::ErrorKind::NotFound => SpawnError::NotFound { program },
            io::ErrorKind::PermissionDenied => SpawnError::PermissionDenied { program },
            _ => SpawnError::Io { program, source },
        }
    }
}

/// Runs `cmd` to its end and returns how it ended with the tails of its output. Exit codes,
/// signals, timeouts and cancellation are all `Ok`; `Err` means it could not start.
///
/// The child leads a new process group; a timeout, a cancellation or dropping this future stops
/// the whole group (SIGTERM, `kill_grace`, SIGKILL) and reaps it, grandchildren included.
/// Processes the child leaves running in its group after it exits are stopped the same way.
///
/// A command with a [`Cmd::supervised`] key runs under a supervisor once
/// [`crate::supervise::enable`] was called, and a record of an earlier orch under the same key
/// is adopted instead of running the command again.
pub async fn run(cmd: &Cmd) -> Result<Output, SpawnError> {
    match &cmd.supervised {
        Some(key)
            if crate::supervise::enabled()
                && !cmd
                    .cancel
                    .as_ref()
                    .is_some_and(CancellationToken::is_cancelled) =>
        {
            crate::supervise::run(cmd, key).await
        }
        _ => run_direct(cmd).await,
    }
}

/// [`run`] in this process, never under a supervisor.
pub(crate) async fn run_direct(cmd: &Cmd) -> Result<Output, SpawnError> {
    let program = || cmd.program.display().to_string();
    if cmd
        .cancel
        .as_ref()
        .is_some_and(CancellationToken::is_cancelled)
    {
        return Ok(Output {
            status: ExitKind::Cancelled,
            stdout_tail: Vec::new(),
            stderr_tail: Vec::new(),
            stdout_bytes: 0,
            stderr_bytes: 0,
            duration: Duration::ZERO,
            supervision: Supervision::Direct,
        });
    }
    if let Some(dir) = &cmd.cwd
        && !dir.is_dir()
    {
        let msg = format!(
            "working directory {} does not exist or is not a directory",
            dir.display()
        );
        return Err(SpawnError::Io {
            program: program(),
            source: io::Error::new(io::ErrorKind::NotFound, msg),
        });
    }
    group::become_subreaper();
    let run_id = crate::records::next_run();

    let prepared = match &cmd.sandbox {
        Some(sb) => Some(prepare_sandbox(cmd, sb, run_id).await?),
        None => None,
    };
    let mut command = match (&cmd.sandbox, &prepared) {
        (Some(sb), Some(p)) => {
            let mut c = Command::new(&sb.bwrap);
            c.args(&p.args);
            confine(&mut c, p, &sb.limits);
            c
        }
        _ => {
            let mut c = Command::new(&cmd.program);
            c.args(&cmd.args);
            c
        }
    };
    if cmd.nice > 0 {
        lower_priority(&mut command, cmd.nice);
    }
    if let Some(dir) = &cmd.cwd {
        command.current_dir(dir);
    }
    if cmd.env_clear || cmd.allow_env.is_some() {
        command.env_clear();
    }
    if let Some(extra) = &cmd.allow_env {
        command.envs(crate::env::allowed(extra));
    }
    for key in &cmd.env_remove {
        command.env_remove(key);
    }
    command.envs(cmd.env.iter().map(|(k, v)| (k, v)));
    // The marker that finds escaped daemons; an explicitly empty environment stays empty.
    if !cmd.env_clear {
        command.env(
            crate::records::INCARNATION_ENV,
            crate::records::marker(run_id),
        );
    }
    let spool_err = |what: &str, e: io::Error| SpawnError::Io {
        program: program(),
        source: io::Error::new(
            e.kind(),
            format!(
                "cannot create the file for the child's {what} in {}: {e}",
                std::env::temp_dir().display()
            ),
        ),
    };
    let mut out = Spool::new(cmd.output_limit).map_err(|e| spool_err("stdout", e))?;
    out.sink = cmd.stdout_sink.clone();
    let mut err = Spool::new(cmd.output_limit).map_err(|e| spool_err("stderr", e))?;
    let stdin = match &cmd.stdin {
        Some(data) => spool::input(data).map_err(|e| spool_err("stdin", e))?,
        None => Stdio::null(),
    };
    command
        .stdin(stdin)
        .stdout(out.child_end().map_err(|e| spool_err("stdout", e))?)
        .stderr(err.child_end().map_err(|e| spool_err("stderr", e))?)
        .process_group(0);

    let started = Instant::now();
    let child =
        group::spawn(&mut command, cmd.no_daemons.then_some(run_id)).map_err(|e| {
            match &cmd.sandbox {
                Some(sb) if e.kind() == io::ErrorKind::NotFound => SpawnError::Sandbox {
                    program: program(),
                    reason: format!(
                        "`{}` is not installed (Debian/Ubuntu: `apt-get install bubblewrap`)",
                        sb.bwrap.display()
                    ),
                },
                _ => SpawnError::from_io(&cmd.program, e),
            }
        })?;
    let pgid = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .unwrap_or(0);

    let mut running = Running {
        child: Some(child),
        pgid,
        grace: cmd.kill_grace,
    };
    tracing::debug!(pgid, cmd = %cmd, "started");

    let ended = CancellationToken::new();
    let tail = async {
        let mut at_end = true;
        loop {
            // At the end of both files: wait for more; else keep reading (a chatty child must
            // not outrun the truncation that bounds its files).
            let pause = if at_end { TAIL_EVERY } else { Duration::ZERO };
            tokio::select! {
                () = ended.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
            at_end = tail_once(&mut out, &mut err, TAIL_BUDGET);
        }
        // The group is gone: what is in the files is all there is. A daemon that escaped the
        // group may still write; it is not waited for, and the last read is bounded so one
        // that writes without end cannot hold the run.
        tail_once(&mut out, &mut err, FINAL_READ_LIMIT);
    };
    let supervise = async {
        let status = running.supervise(cmd.timeout, cmd.cancel.as_ref()).await;
        ended.cancel();
        status
    };
    let ((), status) = tokio::join!(tail, supervise);
    // The sandbox's relays stop and its cgroup goes (killing anything left in it).
    drop(prepared);
    group::reap_adopted();
    // A run that must leave nothing behind: what left its group (a session of its own) ends
    // with it, whether the run exited, timed out or was cancelled.
    if cmd.no_daemons {
        let killed = crate::records::stop_escaped(run_id, group::AFTER_KILL).await;
        if !killed.is_empty() {
            tracing::info!(?killed, cmd = %cmd, "stopped what the run left running outside its process group");
        }
    }
    let mut status = status.map_err(|source| SpawnError::Io {
        program: program(),
        source,
    })?;
    // bwrap reports a program killed by signal N as exit code 128 + N, as a shell does.
    if cmd.sandbox.is_some()
        && let ExitKind::Exited(code) = status
        && (129..=128 + 64).contains(&code)
    {
        status = ExitKind::Signaled(code - 128);
    }
    let (stdout_tail, stdout_bytes) = out.finish();
    let (stderr_tail, stderr_bytes) = err.finish();
    let duration = started.elapsed();
    tracing::debug!(pgid, %status, ?duration, stdout_bytes, stderr_bytes, "finished");
    Ok(Output {
        status,
        stdout_tail,
        stderr_tail,
        stdout_bytes,
        stderr_bytes,
        duration,
        supervision: Supervision::Direct,
    })
}

/// The spawned group while its run is in progress. Dropping it before [`Running::supervise`]
/// finished (the run's future was dropped) stops the group in a background task.
struct Running {
    child: Option<Child>,
    pgid: i32,
    grace: Duration,
}

impl Running {
    /// Waits for the leader, the timeout or the cancellation; stops and reaps the group.
    async fn supervise(
        &mut self,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
    ) -> io::Result<ExitKind> {
        let Some(child) = self.child.as_mut() else {
            return Err(io::Error::other("the child was already released"));
        };
        let cancelled = async {
            match cancel {
                Some(token) => token.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let end = tokio::select! {
            status = child.wait() => End::Exited(status),
            () = tokio::time::sleep(timeout) => End::Stopped(ExitKind::TimedOut),
            () = cancelled => End::Stopped(ExitKind::Cancelled),
        };
        let (result, reaped) = match end {
            End::Exited(Ok(status)) => {
                group::sweep(self.pgid, self.grace).await;
                (Ok(exit_kind(status)), true)
            }
            End::Exited(Err(e)) => {
                let status = group::terminate(child, self.pgid, self.grace).await;
                (Err(e), status.is_some())
            }
            End::Stopped(kind) => {
                tracing::debug!(pgid = self.pgid, %kind, "stopping the process group");
                let status = group::terminate(child, self.pgid, self.grace).await;
                (Ok(kind), status.is_some())
            }
        };
        self.child = None;
        if reaped {
            group::release(self.pgid);
        }
        result
    }
}

enum End {
    Exited(io::Result<ExitStatus>),
    Stopped(ExitKind),
}

impl Drop for Running {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let (pgid, grace) = (self.pgid, self.grace);
        tracing::debug!(pgid, "run dropped; stopping its process group");
        group::signal(pgid, libc::SIGTERM);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if group::terminate(&mut child, pgid, grace).await.is_some() {
                        group::release(pgid);
                    }
                });
            }
            Err(_) => {
                // No runtime to wait in: kill now; tokio's orphan queue reaps the leader.
                group::signal(pgid, libc::SIGKILL);
            }
        }
    }
}

fn exit_kind(status: ExitStatus) -> ExitKind {
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitKind::Exited(code),
        (None, Some(sig)) => ExitKind::Signaled(sig),
        (None, None) => {
            tracing::warn!(?status, "exit status with neither code nor signal");
            ExitKind::Exited(-1)
        }
    }
}

/// Reads what the child wrote to its output files since the last tick. A read error keeps what
/// was read and is logged: the run's outcome does not depend on its capture. Returns whether
/// both files were read to their end.
fn tail_once(out: &mut Spool, err: &mut Spool, budget: usize) -> bool {
    let mut at_end = true;
    for (name, spool) in [("stdout", out), ("stderr", err)] {
        match spool.read_new(budget) {
            Ok(end) => at_end &= end,
            Err(e) => {
                tracing::warn!(error = %e, stream = name, "reading a child's output failed; keeping what was read");
            }
        }
    }
    at_end
}
