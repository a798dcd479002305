//! Commands that outlive orch: a stage's long commands (an agent CLI, a test run, a staging
//! step, a deploy, a rollback) run under a small supervisor of orch's own, so that a crash or an
//! upgrade of orch never cuts one in half, and the next orch on this machine takes over the
//! wait instead of running it again.
//!
//! - The supervisor is orch's own binary started as `orch __supervise <record dir>` in a session
//!   of its own (a signal to orch's group never reaches it). orch hands it the command over a
//!   pipe (never on disk: the command's environment may hold an agent's key); the supervisor
//!   runs it exactly as orch would ([`crate::process::run`]: process group, sandbox and its
//!   network relays, timeout, bounded output), then writes the result into its record directory
//!   atomically and exits. SIGTERM to the supervisor stops the command (cancel, budget, lost
//!   lease) and still writes the result.
//! - A record directory is named by a *key* the caller gives: `j<job>.<label>-<n>`, the n-th
//!   command with that label in one execution of job `<job>` ([`next_key`]). When the job is run
//!   again (orch died, the restarted orch claims it), the same code asks for the same keys in
//!   the same order, and [`crate::process::run`] returns what the record holds: the result of a
//!   command that ended while orch was away ([`Supervision::AdoptedFinished`]), or the result of
//!   one still running, waited for ([`Supervision::AdoptedRunning`]). Only a record whose
//!   supervisor died without a result (the machine rebooted) is discarded and the command run
//!   again ([`Supervision::Restarted`]).
//! - A supervisor that dies without a result (killed on its own) leaves its command running in
//!   its session: orch stops that session's processes, while it waits ([`Supervision::Started`],
//!   [`Supervision::AdoptedRunning`]: the run is then an error, never a success) and before it
//!   runs the command again ([`Supervision::Restarted`]), so two copies never run side by side.
//! - A record is read as it was written and trusted no further: a key that is not one plain
//!   name is refused; a record that is a link or a file, a link inside one, a result that is
//!   not a regular file of valid JSON, are never followed nor taken for success (a record that
//!   is no directory is run again, an unreadable result is an error), with a warning.
//! - A job's records are removed once its outcome is recorded ([`forget_job`], called by the
//!   worker): a retry of the job starts its commands afresh.
//! - [`leave_running`]: orch is stopping (SIGTERM, an upgrade): from then on a cancelled or
//!   dropped wait leaves its command to its supervisor instead of stopping it.
//!
//! Without [`enable`] (library tests, one-shot commands) every command runs directly.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::io::{self, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::process::{Cmd, ExitKind, Output, SpawnError};
use crate::sandbox::Sandbox;

/// The first argument that makes orch's binary a supervisor ([`main`]).
pub const ARG: &str = "__supervise";

/// The supervisor's `<pid> <start time>`, written before it reads the command.
const SUPERVISOR: &str = "supervisor";
/// The result; its presence means the command ended.
const RESULT: &str = "result.json";
/// The captured tails of the command's output.
const STDOUT: &str = "stdout";
const STDERR: &str = "stderr";
/// The supervisor's own messages.
const LOG: &str = "log";
/// The command's whole stdout as it comes, for a command whose caller reads it live
/// ([`Cmd::stdout_sink`]): orch tails it, adopted or not.
const STREAM: &str = "stream";
/// Bytes of stdout the stream file keeps at most (what the caller's sink gets).
const STREAM_MAX: u64 = 64 * 1024 * 1024;
/// How often orch reads a streamed command's new output.
const PUMP_EVERY: Duration = Duration::from_millis(100);
/// How often an adopted command's record is looked at.
const ADOPTED_POLL: Duration = Duration::from_millis(100);
/// Records older than this whose supervisor is gone are removed at start-up.
const STALE_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

struct State {
    dir: PathBuf,
    program: PathBuf,
}

static STATE: OnceLock<State> = OnceLock::new();
static LEAVING: AtomicBool = AtomicBool::new(false);
static LEFT: AtomicBool = AtomicBool::new(false);
/// Per job being executed: how many commands of each label it started so far.
static KEYS: Mutex<Option<HashMap<i64, HashMap<String, u32>>>> = Mutex::new(None);
/// Jobs whose handler waits on a supervised command right now (with how many waits).
static WAITING: Mutex<Option<HashMap<i64, usize>>> = Mutex::new(None);

/// How a run of a [`Cmd`] with a key was supervised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Supervision {
    /// Run directly by orch (no key, or supervision is not enabled).
    #[default]
    Direct,
    /// Started under a supervisor by this orch.
    Started,
    /// Started by an earlier orch and still running: waited for, not run again.
    AdoptedRunning,
    /// Started by an earlier orch and ended while orch was away: its result was read.
    AdoptedFinished,
    /// Its record was lost (the supervisor died without a result): run again.
    Restarted,
}

impl Supervision {
    /// True when the result came from a command an earlier orch started.
    pub fn adopted(self) -> bool {
        matches!(
            self,
            Supervision::AdoptedRunning | Supervision::AdoptedFinished
        )
    }
}

/// Supervises keyed commands from now on, recording them under `dir` (created if missing),
/// with this process's own binary as the supervisor. Call once at start-up (`orch serve`,
/// `orch worker`); later calls keep the first directory. Removes records that are old and
/// whose supervisor is gone.
pub fn enable(dir: &Path) -> io::Result<()> {
    enable_with(dir, crate::sandbox::Init::current_exe()?.program)
}

/// [`enable`] with `program` (an orch binary) as the supervisor: for a process that is not
/// orch itself (the benchmarks).
pub fn enable_with(dir: &Path, program: PathBuf) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let _ = STATE.set(State {
        dir: dir.to_owned(),
        program,
    });
    sweep_stale(dir);
    Ok(())
}

/// Whether keyed commands run under a supervisor.
pub fn enabled() -> bool {
    STATE.get().is_some()
}

/// orch is stopping and leaves its supervised commands running: a cancelled or dropped wait
/// from now on neither stops its command nor returns.
pub fn leave_running() {
    LEAVING.store(true, Ordering::SeqCst);
}

/// Whether [`leave_running`] left at least one wait behind (the process should then exit
/// without running the destructors of the waiting tasks: they own the files the commands use).
pub fn left_running() -> bool {
    LEFT.load(Ordering::SeqCst)
}

fn leaving() -> bool {
    LEAVING.load(Ordering::SeqCst)
}

/// The jobs whose handler is waiting on a supervised command now.
pub fn waiting_jobs() -> HashSet<i64> {
    WAITING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .map(|w| w.keys().copied().collect())
        .unwrap_or_default()
}

/// The key of the next command labelled `label` in this execution of job `job`:
/// `j<job>.<label>-<n>` (the label reduced to letters, digits, `-` and `_`).
pub fn next_key(job: i64, label: &str) -> String {
    let label: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    let mut keys = KEYS.lock().unwrap_or_else(PoisonError::into_inner);
    let n = keys
        .get_or_insert_with(HashMap::new)
        .entry(job)
        .or_default()
        .entry(label.clone())
        .or_insert(0);
    let key = format!("j{job}.{label}-{n}");
    *n += 1;
    key
}

/// An execution of job `job` begins: its keys count from zero again.
pub fn begin_job(job: i64) {
    if let Some(keys) = KEYS.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
        keys.remove(&job);
    }
}

/// Whether job `job` has a record (a command an earlier execution started, running or ended).
pub fn job_has_records(job: i64) -> bool {
    let Some(state) = STATE.get() else {
        return false;
    };
    let prefix = format!("j{job}.");
    std::fs::read_dir(&state.dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with(&prefix) && !name[prefix.len()..].starts_with('~')
        })
    })
}

/// Keeps `bytes` as `name` for job `job` until [`forget_job`] (a caller's own note about the
/// job's supervised commands, e.g. what it saw before starting them). Best effort: a failure
/// is logged. Nothing is kept without supervision.
pub fn keep(job: i64, name: &str, bytes: &[u8]) {
    let Some(state) = STATE.get() else {
        return;
    };
    if let Err(e) = write_durable(&state.dir, &kept_name(job, name), bytes) {
        tracing::warn!(job, name, error = %e, "cannot keep a note about a supervised job");
    }
}

/// What [`keep`] kept as `name` for job `job`, if anything.
pub fn kept(job: i64, name: &str) -> Option<Vec<u8>> {
    let state = STATE.get()?;
    std::fs::read(state.dir.join(kept_name(job, name))).ok()
}

fn kept_name(job: i64, name: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("j{job}.~{name}")
}

/// The durable state directory of the command keyed `key` (`j<job>.~state-<label>-<n>`,
/// mode 0700, created if missing), beside its record but never inside it: what the command
/// keeps across a lost run (an agent CLI's session files) lives here, apart from the
/// supervisor's result files, and goes with the job's records ([`forget_job`]). `None`
/// without supervision (nothing outlives the run then). A state path that is a link or a file
/// is removed (never its target) and made again.
pub fn state_dir(key: &str) -> io::Result<Option<PathBuf>> {
    let Some(state) = STATE.get() else {
        return Ok(None);
    };
    check_key(key)?;
    let Some((job, rest)) = key.split_once('.') else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the supervision key {key:?} names no job"),
        ));
    };
    let dir = state.dir.join(format!("{job}.~state-{rest}"));
    match std::fs::symlink_metadata(&dir) {
        Ok(m) if m.is_dir() => return Ok(Some(dir)),
        Ok(_) => {
            tracing::warn!(dir = %dir.display(), "a command's state directory is not a directory: it is removed");
            remove_record(&dir);
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    Ok(Some(dir))
}

/// What is recorded of the command keyed `key` on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// No record (or no supervision): the next run starts it.
    Absent,
    /// A record with a result, or whose supervisor is alive: the next run adopts it.
    Kept,
    /// A record without a result whose supervisor is gone (the machine restarted, or the
    /// supervisor was killed): the next run runs it again ([`Supervision::Restarted`]). A
    /// caller asks before building the command, to continue what the lost one began.
    Lost,
}

/// What is recorded of the command keyed `key` (see [`Recorded`]).
pub fn recorded(key: &str) -> Recorded {
    let Some(state) = STATE.get() else {
        return Recorded::Absent;
    };
    if check_key(key).is_err() {
        return Recorded::Absent;
    }
    let rdir = state.dir.join(key);
    match std::fs::symlink_metadata(&rdir) {
        Ok(m) if m.is_dir() => {}
        // Not a directory: removed and run again by `run`, as if lost.
        Ok(_) => return Recorded::Lost,
        Err(_) => return Recorded::Absent,
    }
    if std::fs::symlink_metadata(rdir.join(RESULT)).is_ok() || supervisor_alive(&rdir).is_some() {
        Recorded::Kept
    } else {
        Recorded::Lost
    }
}

/// Commands running under a supervisor on this machine: `(key, job, supervisor pid)`.
pub fn running() -> Vec<(String, i64, i32)> {
    let Some(state) = STATE.get() else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&state.dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let key = e.file_name().to_string_lossy().into_owned();
            // Notes and state directories (`j<job>.~…`) are no records.
            if key.contains('~') {
                return None;
            }
            let job = key
                .strip_prefix('j')
                .and_then(|k| k.split_once('.'))
                .and_then(|(j, _)| j.parse::<i64>().ok())?;
            let path = e.path();
            let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
            if !is_dir || std::fs::symlink_metadata(path.join(RESULT)).is_ok() {
                return None;
            }
            supervisor_alive(&path).map(|pid| (key, job, pid))
        })
        .collect()
}

/// The jobs this machine keeps anything of (command records, notes, agent state
/// directories), each once.
pub fn jobs_with_records() -> Vec<i64> {
    let Some(state) = STATE.get() else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&state.dir) else {
        return Vec::new();
    };
    let mut jobs: Vec<i64> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix('j')
                .and_then(|k| k.split_once('.'))
                .and_then(|(j, _)| j.parse().ok())
        })
        .collect();
    jobs.sort_unstable();
    jobs.dedup();
    jobs
}

/// Stops the command under the supervisor `pid` (SIGTERM: it stops the command's group and
/// still writes the result).
pub fn stop(pid: i32) {
    signal(pid, libc::SIGTERM);
}

/// The outcome of job `job` is recorded: its records go (a later attempt runs its commands
/// afresh) and its key counters are reset.
pub fn forget_job(job: i64) {
    begin_job(job);
    let Some(state) = STATE.get() else {
        return;
    };
    let prefix = format!("j{job}.");
    let Ok(entries) = std::fs::read_dir(&state.dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            remove_record(&e.path());
        }
    }
}

fn remove_record(dir: &Path) {
    let is_dir = std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir());
    let removed = if is_dir {
        std::fs::remove_dir_all(dir)
    } else {
        std::fs::remove_file(dir)
    };
    if let Err(e) = removed
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a supervised command's record");
    }
}

fn sweep_stale(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    for e in entries.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|age| age > STALE_AFTER);
        if old && supervisor_alive(&e.path()).is_none() {
            remove_record(&e.path());
        }
    }
}

/// The command as handed to the supervisor: a [`Cmd`] without its cancellation token.
#[derive(Debug, Serialize, Deserialize)]
struct Spec {
    program: PathBuf,
    args: Vec<OsString>,
    cwd: Option<PathBuf>,
    env: Vec<(OsString, OsString)>,
    env_remove: Vec<OsString>,
    env_clear: bool,
    stdin: Option<Vec<u8>>,
    timeout_ms: u64,
    kill_grace_ms: u64,
    output_limit: usize,
    no_daemons: bool,
    nice: i32,
    allow_env: Option<Vec<String>>,
    sandbox: Option<Sandbox>,
    /// The caller reads stdout live: write it to [`STREAM`].
    #[serde(default)]
    stream: bool,
}

impl Spec {
    fn of(cmd: &Cmd) -> Spec {
        Spec {
            program: cmd.program.clone(),
            args: cmd.args.clone(),
            cwd: cmd.cwd.clone(),
            env: cmd.env.clone(),
            env_remove: cmd.env_remove.clone(),
            env_clear: cmd.env_clear,
            stdin: cmd.stdin.clone(),
            timeout_ms: u64::try_from(cmd.timeout.as_millis()).unwrap_or(u64::MAX),
            kill_grace_ms: u64::try_from(cmd.kill_grace.as_millis()).unwrap_or(u64::MAX),
            output_limit: cmd.output_limit,
            no_daemons: cmd.no_daemons,
            nice: cmd.nice,
            allow_env: cmd.allow_env.clone(),
            sandbox: cmd.sandbox.as_deref().cloned(),
            stream: cmd.stdout_sink.is_some(),
        }
    }

    fn into_cmd(self, cancel: CancellationToken, rdir: &Path) -> Cmd {
        let mut cmd = Cmd::new(self.program);
        cmd.args = self.args;
        cmd.cwd = self.cwd;
        cmd.env = self.env;
        cmd.env_remove = self.env_remove;
        cmd.env_clear = self.env_clear;
        cmd.stdin = self.stdin;
        cmd.timeout = Duration::from_millis(self.timeout_ms);
        cmd.kill_grace = Duration::from_millis(self.kill_grace_ms);
        cmd.output_limit = self.output_limit;
        cmd.no_daemons = self.no_daemons;
        cmd.nice = self.nice;
        cmd.allow_env = self.allow_env;
        cmd.sandbox = self.sandbox.map(std::sync::Arc::new);
        cmd.cancel = Some(cancel);
        if self.stream {
            match std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(rdir.join(STREAM))
            {
                Ok(file) => {
                    let file = Mutex::new((file, 0u64));
                    cmd.stdout_sink = Some(crate::process::OutputSink(std::sync::Arc::new(
                        move |chunk: &[u8]| {
                            let mut f = file.lock().unwrap_or_else(PoisonError::into_inner);
                            if f.1 < STREAM_MAX && f.0.write_all(chunk).is_ok() {
                                f.1 += chunk.len() as u64;
                            }
                        },
                    )));
                }
                Err(e) => eprintln!(
                    "orch {ARG}: cannot create {}: {e}; the command's output is not streamed",
                    rdir.join(STREAM).display()
                ),
            }
        }
        cmd
    }
}

/// What the supervisor writes once the command ended (the output tails are files beside it).
#[derive(Debug, Serialize, Deserialize)]
enum Ended {
    Ran {
        status: ExitKind,
        stdout_bytes: u64,
        stderr_bytes: u64,
        duration_ms: u64,
    },
    /// It could not start: the error, as [`SpawnError`] variants.
    NotFound(String),
    PermissionDenied(String),
    Sandbox(String, String),
    Io(String, String),
}

/// Runs `cmd` under a supervisor recorded as `key` (or adopts the record), see the module docs.
pub(crate) async fn run(cmd: &Cmd, key: &str) -> Result<Output, SpawnError> {
    let Some(state) = STATE.get() else {
        return crate::process::run_direct(cmd).await;
    };
    let io_err = |what: String, e: io::Error| SpawnError::Io {
        program: cmd.program.display().to_string(),
        source: io::Error::new(e.kind(), format!("{what}: {e}")),
    };
    check_key(key).map_err(|e| io_err(format!("cannot supervise `{cmd}`"), e))?;
    let rdir = state.dir.join(key);
    let job = key
        .strip_prefix('j')
        .and_then(|k| k.split_once('.'))
        .and_then(|(j, _)| j.parse::<i64>().ok());
    let _waiting = Waiting::new(job);
    let found = match std::fs::symlink_metadata(&rdir) {
        Ok(m) if m.is_dir() => true,
        Ok(_) => {
            // Never followed: a link may point anywhere (something with access to the records
            // planted it), and a plain file is no record.
            tracing::warn!(key, dir = %rdir.display(),
                "a supervised command's record is not a directory (a symbolic link or a file): it is removed and the command runs again");
            remove_record(&rdir);
            let out = start(cmd, state, &rdir, &io_err).await?;
            return Ok(with(out, Supervision::Restarted));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(io_err(format!("cannot inspect {}", rdir.display()), e)),
    };
    if found {
        if let Some(result) = read_result(&rdir) {
            tracing::info!(
                key,
                "a supervised command ended while orch was away: its result is taken, it is not run again"
            );
            pump(&mut Pump::of(cmd, &rdir));
            return result.map(|out| with(out, Supervision::AdoptedFinished));
        }
        if let Some(pid) = supervisor_alive(&rdir) {
            tracing::info!(
                key,
                pid,
                "a supervised command started by an earlier orch is still running: adopted"
            );
            let out = wait_adopted(cmd, &rdir, pid).await?;
            return Ok(with(out, Supervision::AdoptedRunning));
        }
        tracing::warn!(key, dir = %rdir.display(),
            "a supervised command's record has no result and its supervisor is gone (the machine restarted, or it was killed): the command runs again");
        stop_orphaned_command(&rdir, cmd.kill_grace).await;
        remove_record(&rdir);
        let out = start(cmd, state, &rdir, &io_err).await?;
        return Ok(with(out, Supervision::Restarted));
    }
    let out = start(cmd, state, &rdir, &io_err).await?;
    Ok(with(out, Supervision::Started))
}

fn with(mut out: Output, how: Supervision) -> Output {
    out.supervision = how;
    out
}

/// Marks the job as waiting on a supervised command while it lives.
struct Waiting(Option<i64>);

impl Waiting {
    fn new(job: Option<i64>) -> Waiting {
        if let Some(job) = job {
            *WAITING
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert_with(HashMap::new)
                .entry(job)
                .or_default() += 1;
        }
        Waiting(job)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(job) = self.0 else {
            return;
        };
        let mut waiting = WAITING.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = waiting.as_mut()
            && let Some(n) = w.get_mut(&job)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                w.remove(&job);
            }
        }
    }
}

/// The supervisor as a registered leader of orch's (see [`crate::group::spawn_unrecorded`]),
/// forgotten once the wait for it ends (or is given up).
struct Leader(i32);

impl Drop for Leader {
    fn drop(&mut self) {
        crate::group::release(self.0);
    }
}

/// Hands a supervised command's streamed stdout to the caller's sink as it grows.
struct Pump {
    path: PathBuf,
    pos: u64,
    sink: crate::process::OutputSink,
}

impl Pump {
    fn of(cmd: &Cmd, rdir: &Path) -> Option<Pump> {
        cmd.stdout_sink.clone().map(|sink| Pump {
            path: rdir.join(STREAM),
            pos: 0,
            sink,
        })
    }

    /// Reads what was appended since the last call (a missing file is nothing yet).
    fn pump(&mut self) {
        use std::io::Seek as _;
        let Ok(mut f) = open_nofollow(&self.path) else {
            return;
        };
        if f.seek(io::SeekFrom::Start(self.pos)).is_err() {
            return;
        }
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match f.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    self.pos += n as u64;
                    (self.sink.0)(&buf[..n]);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(file = %self.path.display(), error = %e, "cannot read a supervised command's output stream");
                    return;
                }
            }
        }
    }
}

fn pump(p: &mut Option<Pump>) {
    if let Some(p) = p.as_mut() {
        p.pump();
    }
}

/// Stops the supervisor's command (SIGTERM) when the wait is dropped, unless orch is leaving.
struct StopOnDrop(i32, bool);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if self.1 {
            return;
        }
        if leaving() {
            LEFT.store(true, Ordering::SeqCst);
            return;
        }
        signal(self.0, libc::SIGTERM);
    }
}

fn signal(pid: i32, sig: i32) {
    if pid > 1 {
        // SAFETY: kill takes plain integers; pid > 1 is one process, never a group or all.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

async fn start(
    cmd: &Cmd,
    state: &State,
    rdir: &Path,
    io_err: &impl Fn(String, io::Error) -> SpawnError,
) -> Result<Output, SpawnError> {
    std::fs::create_dir(rdir)
        .map_err(|e| io_err(format!("cannot create {}", rdir.display()), e))?;
    let spec = serde_json::to_vec(&Spec::of(cmd)).map_err(|e| {
        remove_record(rdir);
        io_err("cannot encode the command".into(), io::Error::other(e))
    })?;
    let log = std::fs::File::create(rdir.join(LOG))
        .map_err(|e| io_err(format!("cannot create {}", rdir.join(LOG).display()), e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| io_err("cannot share the supervisor's log".into(), e))?;
    let mut command = tokio::process::Command::new(&state.program);
    // The supervisor's environment is no more than its command gets from orch's: it
    // outlives orch in a session of its own, and its `/proc/<pid>/environ` is readable by the
    // user's processes (an unsandboxed agent reads its parent's). A command on an allowlist
    // (an agent) needs only those variables from it; one that inherits (a deploy) needs
    // orch's environment, never its secrets.
    if cmd.env_clear || cmd.allow_env.is_some() {
        command.env_clear();
        command.envs(crate::env::allowed(
            cmd.allow_env.as_deref().unwrap_or_default(),
        ));
    } else {
        for name in crate::env::secrets_present() {
            command.env_remove(name);
        }
    }
    command
        .arg(ARG)
        .arg(rdir)
        .stdin(std::process::Stdio::piped())
        .stdout(log)
        .stderr(log2)
        .kill_on_drop(false);
    // SAFETY: runs in the forked child before exec; setsid is async-signal-safe. A session of
    // its own: no signal for orch's group or terminal reaches the supervisor.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = crate::group::spawn_unrecorded(&mut command).map_err(|e| {
        remove_record(rdir);
        io_err(
            format!("cannot start the supervisor {}", state.program.display()),
            e,
        )
    })?;
    let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
    // The supervisor is not reaped before the wait below ends: its start is still readable.
    let since = crate::records::start_time(pid);
    let mut guard = StopOnDrop(pid, false);
    let _leader = Leader(pid);
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt as _;
        let written = stdin.write_all(&spec).await;
        drop(stdin);
        if let Err(e) = written {
            return Err(io_err(
                "cannot hand the command to its supervisor".into(),
                e,
            ));
        }
    }
    let cancel = cmd.cancel.clone().unwrap_or_default();
    let mut signalled = false;
    let mut stream = Pump::of(cmd, rdir);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            () = tokio::time::sleep(PUMP_EVERY), if stream.is_some() => pump(&mut stream),
            () = cancel.cancelled(), if !signalled => {
                if leaving() {
                    LEFT.store(true, Ordering::SeqCst);
                    guard.1 = true;
                    std::future::pending::<()>().await;
                }
                signal(pid, libc::SIGTERM);
                signalled = true;
            }
        }
    };
    guard.1 = true;
    pump(&mut stream);
    if let Some(result) = read_result(rdir) {
        return result;
    }
    let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
    // Its command, in the supervisor's session, would run on unwatched: it is stopped (the
    // caller decides whether to run it again, and two copies must never run side by side).
    let stopped = match since {
        Some(since) => crate::group::stop_session(pid, since, cmd.kill_grace).await,
        None => 0,
    };
    tracing::warn!(dir = %rdir.display(), pid, %status, stopped,
        "a supervisor ended without a result; the processes it left were stopped");
    Err(io_err(
        format!(
            "the supervisor of `{cmd}` ended ({status}) without a result (the command did not \
             finish; {stopped} process(es) it left running were stopped); its log: {}",
            log_tail(rdir)
        ),
        io::Error::other("no result"),
    ))
}

async fn wait_adopted(cmd: &Cmd, rdir: &Path, pid: i32) -> Result<Output, SpawnError> {
    let since = recorded_supervisor(rdir).map(|(_, start)| start);
    let mut guard = StopOnDrop(pid, false);
    let cancel = cmd.cancel.clone().unwrap_or_default();
    let mut signalled = false;
    let mut stream = Pump::of(cmd, rdir);
    loop {
        tokio::select! {
            () = tokio::time::sleep(ADOPTED_POLL) => {}
            () = cancel.cancelled(), if !signalled => {
                if leaving() {
                    LEFT.store(true, Ordering::SeqCst);
                    guard.1 = true;
                    std::future::pending::<()>().await;
                }
                signal(pid, libc::SIGTERM);
                signalled = true;
            }
        }
        pump(&mut stream);
        if let Some(result) = read_result(rdir) {
            guard.1 = true;
            pump(&mut stream);
            return result;
        }
        if supervisor_alive(rdir).is_none() {
            guard.1 = true;
            pump(&mut stream);
            // It may have written the result just before it exited.
            if let Some(result) = read_result(rdir) {
                return result;
            }
            let stopped = match since {
                Some(since) => crate::group::stop_session(pid, since, cmd.kill_grace).await,
                None => 0,
            };
            tracing::warn!(dir = %rdir.display(), pid, stopped,
                "an adopted command's supervisor ended without a result; the processes it left were stopped");
            return Err(SpawnError::Io {
                program: cmd.program.display().to_string(),
                source: io::Error::other(format!(
                    "the adopted command's supervisor (pid {pid}) ended without a result (the \
                     command did not finish; {stopped} process(es) it left running were \
                     stopped); its log: {}",
                    log_tail(rdir)
                )),
            });
        }
    }
}

/// The pid of the record's supervisor while it runs (zombies count as gone).
fn supervisor_alive(rdir: &Path) -> Option<i32> {
    let (pid, start) = recorded_supervisor(rdir)?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    (crate::records::start_time(pid) == Some(start)).then_some(pid)
}

/// The result in `rdir`, once the supervisor wrote it.
fn read_result(rdir: &Path) -> Option<Result<Output, SpawnError>> {
    let unreadable = |e: String| {
        tracing::warn!(dir = %rdir.display(), error = %e, "a supervised command's result is unreadable");
        Some(Err(SpawnError::Io {
            program: rdir.display().to_string(),
            source: io::Error::other(format!(
                "the supervised command's result is unreadable: {e}"
            )),
        }))
    };
    let bytes = match read_record_file(rdir, RESULT) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => return unreadable(e.to_string()),
    };
    let ended: Ended = match serde_json::from_slice(&bytes) {
        Ok(e) => e,
        Err(e) => return unreadable(e.to_string()),
    };
    Some(match ended {
        Ended::Ran {
            status,
            stdout_bytes,
            stderr_bytes,
            duration_ms,
        } => Ok(Output {
            status,
            stdout_tail: read_tail(rdir, STDOUT),
            stderr_tail: read_tail(rdir, STDERR),
            stdout_bytes,
            stderr_bytes,
            duration: Duration::from_millis(duration_ms),
            supervision: Supervision::Started,
        }),
        Ended::NotFound(program) => Err(SpawnError::NotFound { program }),
        Ended::PermissionDenied(program) => Err(SpawnError::PermissionDenied { program }),
        Ended::Sandbox(program, reason) => Err(SpawnError::Sandbox { program, reason }),
        Ended::Io(program, message) => Err(SpawnError::Io {
            program,
            source: io::Error::other(message),
        }),
    })
}

/// Refuses a key that is not one plain name inside the records directory: empty, too long,
/// hidden (`.`, `..`, the `.<name>.tmp` files), or with anything but letters, digits, `.`, `-`
/// and `_` (a `/`, a NUL, a `~` of the kept notes).
fn check_key(key: &str) -> io::Result<()> {
    let plain = key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if key.is_empty() || key.len() > 200 || key.starts_with('.') || !plain {
        let shown: String = key.chars().take(80).collect();
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the supervision key {shown:?} is not a plain name (1 to 200 letters, digits, \
                 `.`, `-`, `_`, not starting with `.`)"
            ),
        ));
    }
    Ok(())
}

/// Opens `path` for reading without following a symbolic link, and only if it is a regular
/// file: a record's files are read as written, never through a link planted in it.
fn open_nofollow(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(f)
}

/// The file `name` of record `rdir` (see [`open_nofollow`]).
fn read_record_file(rdir: &Path, name: &str) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    open_nofollow(&rdir.join(name))?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// An output tail of the record; one that cannot be read is empty (and logged).
fn read_tail(rdir: &Path, name: &str) -> Vec<u8> {
    read_record_file(rdir, name).unwrap_or_else(|e| {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(dir = %rdir.display(), file = name, error = %e,
                "a supervised command's output tail is unreadable; it is taken as empty");
        }
        Vec::new()
    })
}

/// The `<pid> <start time>` the record's supervisor wrote, if it is readable.
fn recorded_supervisor(rdir: &Path) -> Option<(i32, u64)> {
    let bytes = read_record_file(rdir, SUPERVISOR).ok()?;
    let text = std::str::from_utf8(&bytes).ok()?;
    let mut parts = text.split_whitespace();
    let pid: i32 = parts.next()?.parse().ok()?;
    let start: u64 = parts.next()?.parse().ok()?;
    // Never orch itself (a planted file must not make orch signal itself).
    (pid > 1 && u32::try_from(pid).ok() != Some(std::process::id())).then_some((pid, start))
}

/// A record without a result whose supervisor is gone: if the supervisor was killed on its own
/// since the machine booted, its command may still run (in its session); it is stopped before
/// the command runs again. Nothing is touched when the record predates the boot (its processes
/// died with the machine and its pid may now name another session) or when another process
/// now has the supervisor's pid.
async fn stop_orphaned_command(rdir: &Path, grace: Duration) {
    let Some((pid, start)) = recorded_supervisor(rdir) else {
        return;
    };
    let current = crate::records::start_time(pid);
    if current.is_some_and(|s| s != start) {
        return;
    }
    // The supervisor writes its file as it starts: a file written since this boot, at the
    // time its start tick says, is this boot's supervisor (not a stale or garbled one).
    let written = std::fs::symlink_metadata(rdir.join(SUPERVISOR)).and_then(|m| m.modified());
    // SAFETY: sysconf takes an integer and touches no memory of ours.
    let ticks = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(0);
    let started = boot_time()
        .filter(|_| ticks > 0)
        .and_then(|boot| boot.checked_add(Duration::from_secs(start / ticks.max(1))));
    let consistent = match (written, started) {
        (Ok(w), Some(s)) => {
            let apart = w.duration_since(s).unwrap_or_else(|e| e.duration());
            apart < Duration::from_secs(120)
        }
        _ => false,
    };
    if !consistent {
        tracing::debug!(dir = %rdir.display(), pid, "a dead supervisor's record is not of this boot: nothing to stop");
        return;
    }
    let stopped = crate::group::stop_session(pid, start, grace).await;
    if stopped > 0 {
        tracing::warn!(dir = %rdir.display(), pid, stopped,
            "the dead supervisor's command was still running: stopped before it runs again");
    }
}

/// When the machine booted (`btime` of `/proc/stat`).
fn boot_time() -> Option<SystemTime> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs))
}

fn log_tail(rdir: &Path) -> String {
    let text = read_record_file(rdir, LOG)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let text = crate::process::last_lines(&text, 5);
    if text.is_empty() {
        "(empty)".to_owned()
    } else {
        text
    }
}

/// Writes `name` in `dir` so that it is either absent or whole, and durable once this returns.
fn write_durable(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))?;
    std::fs::File::open(dir)?.sync_all()
}

/// The supervisor: `orch __supervise <record dir>`, the command on stdin as JSON. Returns the
/// process's exit code (0 once the result is written).
pub fn main(args: &[OsString]) -> i32 {
    let Some(rdir) = args.first().map(PathBuf::from) else {
        eprintln!("orch {ARG}: no record directory");
        return 2;
    };
    let me = std::process::id() as i32;
    let pid = format!("{me} {}\n", crate::records::start_time(me).unwrap_or(0));
    if let Err(e) = write_durable(&rdir, SUPERVISOR, pid.as_bytes()) {
        eprintln!(
            "orch {ARG}: cannot write {}: {e}",
            rdir.join(SUPERVISOR).display()
        );
        return 1;
    }
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        eprintln!("orch {ARG}: cannot read the command: {e}");
        return 1;
    }
    let spec: Spec = match serde_json::from_slice(&input) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "orch {ARG}: the command is unreadable ({e}); orch stopped before it was handed over"
            );
            return 1;
        }
    };
    drop(input);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("orch {ARG}: cannot start the async runtime: {e}");
            return 1;
        }
    };
    let ended = runtime.block_on(async {
        let cancel = CancellationToken::new();
        let cmd = spec.into_cmd(cancel.clone(), &rdir);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| eprintln!("orch {ARG}: cannot watch SIGTERM ({e}); the command cannot be stopped early"))
            .ok();
        let run = crate::process::run_direct(&cmd);
        tokio::pin!(run);
        loop {
            tokio::select! {
                r = &mut run => break r,
                Some(()) = async { match term.as_mut() { Some(t) => t.recv().await, None => std::future::pending().await } } => {
                    cancel.cancel();
                }
            }
        }
    });
    let (result, tails) = match ended {
        Ok(out) => (
            Ended::Ran {
                status: out.status,
                stdout_bytes: out.stdout_bytes,
                stderr_bytes: out.stderr_bytes,
                duration_ms: u64::try_from(out.duration.as_millis()).unwrap_or(u64::MAX),
            },
            Some((out.stdout_tail, out.stderr_tail)),
        ),
        Err(SpawnError::NotFound { program }) => (Ended::NotFound(program), None),
        Err(SpawnError::PermissionDenied { program }) => (Ended::PermissionDenied(program), None),
        Err(SpawnError::Sandbox { program, reason }) => (Ended::Sandbox(program, reason), None),
        Err(SpawnError::Io { program, source }) => (Ended::Io(program, source.to_string()), None),
    };
    if let Some((out, err)) = tails {
        for (name, bytes) in [(STDOUT, out), (STDERR, err)] {
            if let Err(e) = write_durable(&rdir, name, &bytes) {
                eprintln!(
                    "orch {ARG}: cannot write {}: {e}",
                    rdir.join(name).display()
                );
                return 1;
            }
        }
    }
    let json = match serde_json::to_vec(&result) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("orch {ARG}: cannot encode the result: {e}");
            return 1;
        }
    };
    if let Err(e) = write_durable(&rdir, RESULT, &json) {
        eprintln!(
            "orch {ARG}: cannot write {}: {e}",
            rdir.join(RESULT).display()
        );
        return 1;
    }
    0
}
