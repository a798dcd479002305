//! The sandbox orch runs untrusted children in: agents, and the repository's own code (tests,
//! verification, staging steps). An agent is treated as an attacker (a prompt-injected model
//! is one), and so is the code an agent wrote.
//!
//! On Linux a sandboxed [`crate::Cmd`] runs under bubblewrap (`bwrap`), starting from nothing
//! and granting:
//! - the file system read-only (`/` bound read-only), with a private `/tmp`, `/run` and `/proc`
//!   (a new pid namespace: the run sees only its own processes, never orch's `/proc/<pid>`),
//!   a minimal `/dev`;
//! - [`Sandbox::hidden`] paths covered by an empty directory (or `/dev/null` for a file): orch's
//!   database, configuration and state, its clones and the other worktrees, the user's
//!   checkouts, the user's `HOME`;
//! - [`Sandbox::read_only`] paths shown again read-only inside hidden ones (the repository's git
//!   directory, toolchains that live under `HOME`), and [`Sandbox::writable`] paths bound
//!   read-write (the work item's worktree, the run's private home); every mount is applied
//!   shallow-first, so a deeper rule wins over a shallower one;
//! - the program itself, its interpreter (`#!`) and the `PATH` directories under a hidden path
//!   are shown read-only (a CLI installed under `HOME`), except what [`Sandbox::hidden`] names;
//! - no capabilities (`--cap-drop ALL`), a new session, its own IPC/UTS namespaces, and every
//!   process of the run ends with it (the pid namespace dies with its first process; bwrap dies
//!   with orch's run of it);
//! - limits ([`Limits`]): processes and memory through a cgroup of its own when this machine
//!   lets orch make one (cgroup v2 or v1 `pids`/`memory`), CPU seconds and file size through
//!   rlimits (and processes through `RLIMIT_NPROC` as well, which the kernel does not apply to
//!   root);
//! - the network ([`Network`]): none (a network namespace with only its own loopback), the
//!   host's, or an allowlist. An allowlist is enforced outside the sandbox: the run's network
//!   namespace has no route anywhere; a relay inside it ([`init_main`], run as the sandbox's
//!   first process) listens on loopback and passes each connection over a Unix socket to orch,
//!   which connects only to the listed endpoints. A loopback endpoint (`127.0.0.1:8080`) is
//!   reachable inside at the same address; other hosts through an HTTP `CONNECT` proxy at
//!   [`PROXY_PORT`] ([`Sandbox::proxy_env`]) that refuses anything not listed.
//!
//! What this module does not do: choose what to hide or allow (the runner knows orch's paths
//! and the repo's configuration), or decide whether a run may go unsandboxed (the runner does,
//! from `sandbox = "off"`).

use std::collections::BTreeSet;
use std::ffi::{CString, OsStr, OsString};
use std::io::{self, Read as _, Write as _};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::task::JoinSet;

pub use orch_domain::net::Endpoint;

/// The port of the `CONNECT` proxy inside a sandbox whose allowlist names a host that is not
/// loopback (unless an allowed loopback endpoint uses it: then the next free one).
pub const PROXY_PORT: u16 = 3128;
/// The first argument that makes orch's binary the sandbox's relay ([`init_main`]).
pub const INIT_ARG: &str = "__sandbox-init";
/// Bytes of a `CONNECT` request head orch reads at most.
const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// How long a `CONNECT` request head may take to arrive.
const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long orch waits to connect an allowed endpoint for the sandbox.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Files that hold credentials inside directories a sandbox may see (a toolchain's home):
/// always covered.
const CREDENTIAL_FILES: [&str; 4] = [
    ".cargo/credentials",
    ".cargo/credentials.toml",
    ".npmrc",
    ".pypirc",
];

/// What a sandboxed run may reach over the network.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Network {
    /// Nothing: a network namespace of its own with only its loopback.
    #[default]
    None,
    /// The host's network, unrestricted (a repo's tests that must reach a service).
    Host,
    /// Only these endpoints, enforced by orch outside the sandbox.
    Allow(Vec<Endpoint>),
}

/// Resource limits of one sandboxed run; `None` leaves one unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Processes (and threads) alive at once in the run.
    pub processes: Option<u64>,
    /// Memory of the whole run, bytes.
    pub memory_bytes: Option<u64>,
    /// CPU seconds of each process.
    pub cpu_seconds: Option<u64>,
    /// The largest file a process of the run may write, bytes.
    pub file_bytes: Option<u64>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            processes: Some(1024),
            memory_bytes: Some(8 << 30),
            cpu_seconds: Some(4 * 3600),
            file_bytes: Some(4 << 30),
        }
    }
}

/// The program that runs as the sandbox's first process when the network is an allowlist:
/// orch's own binary with [`INIT_ARG`] (see [`init_main`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Init {
    /// The program.
    pub program: PathBuf,
    /// Arguments before the relay's own (`[INIT_ARG]` for orch's binary).
    pub args: Vec<OsString>,
}

impl Init {
    /// orch's own running binary as the relay. When that file was replaced since orch started
    /// (an upgrade: the kernel then names it `… (deleted)`), the new binary at the same path.
    pub fn current_exe() -> io::Result<Init> {
        let mut program = std::env::current_exe()?;
        if !program.exists()
            && let Some(name) = program.to_str()
            && let Some(path) = name.strip_suffix(" (deleted)")
        {
            program = PathBuf::from(path);
        }
        Ok(Init {
            program,
            args: vec![INIT_ARG.into()],
        })
    }
}

/// How one run is contained. Build it with [`Sandbox::new`] and the fields; give it to a
/// [`crate::Cmd`] with [`crate::Cmd::sandbox`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Sandbox {
    /// The bubblewrap binary (`bwrap` is looked up in `PATH`).
    pub bwrap: PathBuf,
    /// Bound read-write at the same path.
    pub writable: Vec<PathBuf>,
    /// Bound read-only at the same path (shown again inside a hidden path).
    pub read_only: Vec<PathBuf>,
    /// Covered: an empty directory over a directory, `/dev/null` over a file.
    pub hidden: Vec<PathBuf>,
    /// What the run may reach.
    pub network: Network,
    /// Its resource limits.
    pub limits: Limits,
    /// The relay program, needed when [`Sandbox::network`] is an allowlist.
    pub init: Option<Init>,
}

impl Sandbox {
    /// A sandbox that hides `HOME` (of orch's environment) and allows nothing else yet.
    pub fn new() -> Sandbox {
        let hidden = std::env::var_os("HOME")
            .map(PathBuf::from)
            .filter(|h| h.is_absolute() && h != Path::new("/"))
            .into_iter()
            .collect();
        Sandbox {
            bwrap: PathBuf::from("bwrap"),
            writable: Vec::new(),
            read_only: Vec::new(),
            hidden,
            network: Network::None,
            limits: Limits::default(),
            init: Init::current_exe().ok(),
        }
    }

    /// The variables that send a run's HTTP(S) traffic through the sandbox's proxy, when its
    /// allowlist names a host that is not loopback (loopback endpoints are reached directly).
    pub fn proxy_env(&self) -> Vec<(String, String)> {
        let Network::Allow(endpoints) = &self.network else {
            return Vec::new();
        };
        if endpoints.iter().all(Endpoint::is_loopback) {
            return Vec::new();
        }
        let url = format!("http://127.0.0.1:{}", proxy_port(endpoints));
        let no_proxy = "localhost,127.0.0.1,::1".to_owned();
        vec![
            ("HTTPS_PROXY".into(), url.clone()),
            ("https_proxy".into(), url.clone()),
            ("HTTP_PROXY".into(), url.clone()),
            ("http_proxy".into(), url.clone()),
            ("ALL_PROXY".into(), url.clone()),
            ("all_proxy".into(), url),
            ("NO_PROXY".into(), no_proxy.clone()),
            ("no_proxy".into(), no_proxy),
        ]
    }
}

impl Default for Sandbox {
    fn default() -> Sandbox {
        Sandbox::new()
    }
}

/// The address a relay inside the sandbox listens on for a loopback endpoint.
fn listen_addr(endpoint: &Endpoint) -> String {
    match endpoint.host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(ip)) => format!("[{ip}]:{}", endpoint.port),
        Ok(ip) => format!("{ip}:{}", endpoint.port),
        Err(_) => format!("127.0.0.1:{}", endpoint.port),
    }
}

/// The proxy's port: [`PROXY_PORT`], or the next one no allowed loopback endpoint uses.
fn proxy_port(endpoints: &[Endpoint]) -> u16 {
    let mut port = PROXY_PORT;
    while endpoints.iter().any(|e| e.is_loopback() && e.port == port) {
        port = port.wrapping_add(1).max(1024);
    }
    port
}

/// Whether a sandbox can be set up on this machine: `Ok(bwrap's version)`, or why not (bwrap
/// missing, namespaces refused). Checked once per process by running a trivial sandbox.
pub fn probe(bwrap: &Path) -> Result<String, String> {
    /// Each bwrap program probed, and what its probe said.
    type Probed = Vec<(PathBuf, Result<String, String>)>;
    static PROBED: OnceLock<std::sync::Mutex<Probed>> = OnceLock::new();
    let cache = PROBED.get_or_init(Default::default);
    if let Ok(seen) = cache.lock()
        && let Some((_, result)) = seen.iter().find(|(p, _)| p == bwrap)
    {
        return result.clone();
    }
    let result = probe_now(bwrap);
    if let Ok(mut seen) = cache.lock() {
        seen.push((bwrap.to_owned(), result.clone()));
    }
    result
}

fn probe_now(bwrap: &Path) -> Result<String, String> {
    let version = std::process::Command::new(bwrap)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => format!(
                "`{}` is not installed (Debian/Ubuntu: `apt-get install bubblewrap`)",
                bwrap.display()
            ),
            _ => format!("cannot run `{}`: {e}", bwrap.display()),
        })?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_owned();
    let mut args: Vec<OsString> = base_args();
    args.extend(["--ro-bind", "/", "/", "--", "true"].map(OsString::from));
    let out = std::process::Command::new(bwrap)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `{}`: {e}", bwrap.display()))?;
    if out.status.success() {
        Ok(version)
    } else {
        Err(format!(
            "`{}` cannot create namespaces here: {}",
            bwrap.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The options every sandbox gets.
fn base_args() -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--cap-drop",
        "ALL",
    ]
    .map(OsString::from)
    .to_vec();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        args.push("--unshare-user".into());
    }
    args
}

/// One mount of the sandbox's file system.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mount {
    Hide(PathBuf),
    ReadOnly(PathBuf),
    Writable(PathBuf),
}

impl Mount {
    fn path(&self) -> &Path {
        match self {
            Mount::Hide(p) | Mount::ReadOnly(p) | Mount::Writable(p) => p,
        }
    }

    /// Order of mounts on the same path: hide, then show.
    fn rank(&self) -> u8 {
        match self {
            Mount::Hide(_) => 0,
            Mount::ReadOnly(_) => 1,
            Mount::Writable(_) => 2,
        }
    }
}

/// A path made absolute and lexically normal (`..` and `.` resolved, no symlink followed),
/// then with its existing symlinks resolved when it exists (a bind follows them anyway).
fn normal(path: &Path) -> Option<PathBuf> {
    if !path.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
        }
    }
    Some(std::fs::canonicalize(&out).unwrap_or(out))
}

fn depth(path: &Path) -> usize {
    path.components().count()
}

/// Paths the sandbox replaces with fresh ones whatever the configuration says.
const FRESH: [&str; 3] = ["/tmp", "/run", "/proc"];

fn under_fresh(path: &Path) -> bool {
    FRESH.iter().any(|f| path.starts_with(f))
}

/// Everything a run's file system needs, in the order bwrap applies it.
fn mounts(sandbox: &Sandbox, program: &Path, path_env: Option<&OsStr>) -> Vec<Mount> {
    let hidden: Vec<PathBuf> = sandbox.hidden.iter().filter_map(|p| normal(p)).collect();
    let covered = |p: &Path| under_fresh(p) || hidden.iter().any(|h| p.starts_with(h));
    let mut shown: BTreeSet<PathBuf> = BTreeSet::new();
    // The program, what runs it, and the PATH entries under a hidden path: a CLI installed
    // under HOME, its interpreter, a toolchain's shims.
    for p in program_paths(program, path_env) {
        if covered(&p)
            && let Some(prefix) = install_prefix(&p, &hidden)
        {
            shown.insert(prefix);
        }
    }
    if let Some(init) = &sandbox.init
        && let Some(p) = normal(&init.program)
        && covered(&p)
    {
        shown.insert(p);
    }
    if let Some(path_env) = path_env {
        for dir in std::env::split_paths(path_env) {
            if let Some(dir) = normal(&dir)
                && dir.is_dir()
                && covered(&dir)
                && let Some(top) = top_under(&dir, &hidden)
            {
                shown.insert(top);
            }
        }
    }
    let mut list: Vec<Mount> = Vec::new();
    for h in &hidden {
        if !under_fresh(h) && h != Path::new("/") {
            list.push(Mount::Hide(h.clone()));
        }
    }
    for p in shown {
        for cred in CREDENTIAL_FILES {
            let file = p.join(cred);
            if file.exists() {
                list.push(Mount::Hide(file));
            }
        }
        // A shown directory never shows what is hidden below it.
        for h in &hidden {
            if h.starts_with(&p) && h != &p {
                list.push(Mount::Hide(h.clone()));
            }
        }
        list.push(Mount::ReadOnly(p));
    }
    for p in sandbox.read_only.iter().filter_map(|p| normal(p)) {
        list.push(Mount::ReadOnly(p));
    }
    for p in sandbox.writable.iter().filter_map(|p| normal(p)) {
        list.push(Mount::Writable(p));
    }
    list.retain(|m| m.path().exists());
    list.sort_by(|a, b| {
        depth(a.path())
            .cmp(&depth(b.path()))
            .then(a.rank().cmp(&b.rank()))
            .then(a.path().cmp(b.path()))
    });
    list.dedup();
    list
}

/// The program as found on `PATH`, its target, and its interpreter when it is a script.
fn program_paths(program: &Path, path_env: Option<&OsStr>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Some(found) = which(program, path_env) else {
        return out;
    };
    if let Some(p) = normal(found.parent().unwrap_or(Path::new("/"))) {
        out.push(p.join(found.file_name().unwrap_or_default()));
    }
    // Every link on the way to the file (`…/newest/bin/claude` → `…/node_modules/.bin/claude`
    // → `…/claude-code/bin/claude.exe`): a hop the sandbox does not show breaks the chain.
    let mut cur = found.clone();
    for _ in 0..40 {
        let Ok(target) = std::fs::read_link(&cur) else {
            break;
        };
        let next = cur.parent().unwrap_or(Path::new("/")).join(target);
        let Some(hop) = next
            .parent()
            .and_then(normal)
            .map(|dir| dir.join(next.file_name().unwrap_or_default()))
        else {
            break;
        };
        out.push(hop.clone());
        cur = hop;
    }
    if let Ok(real) = std::fs::canonicalize(&found) {
        if let Some(interp) = interpreter(&real, path_env)
            && let Ok(i) = std::fs::canonicalize(&interp)
        {
            out.push(interp);
            out.push(i);
        }
        out.push(real);
    }
    out
}

/// The directories a sandbox must show for `program` to run: its install prefix (the parent of
/// its `bin` directory, else its directory), that of the file a link points to, and its
/// interpreter's. For a program that another script runs (a wrapper), which the sandbox cannot
/// see coming: name these in the sandbox's read-only paths.
pub fn install_dirs(program: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = program_paths(program, None)
        .iter()
        .filter_map(|p| install_prefix(p, &[]))
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// `program` resolved the way `execvp` would: a path as is, a bare name on `PATH`.
pub fn which(program: &Path, path_env: Option<&OsStr>) -> Option<PathBuf> {
    if program.components().count() > 1 || program.is_absolute() {
        return program.is_file().then(|| program.to_owned());
    }
    let path_env = path_env
        .map(OsStr::to_owned)
        .or_else(|| std::env::var_os("PATH"))?;
    std::env::split_paths(&path_env)
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt as _;
                m.is_file() && m.permissions().mode() & 0o111 != 0
            })
        })
}

/// The interpreter a `#!` line names (`/usr/bin/env node` → `node` on `PATH`).
fn interpreter(script: &Path, path_env: Option<&OsStr>) -> Option<PathBuf> {
    let mut head = [0u8; 256];
    let n = std::fs::File::open(script)
        .and_then(|mut f| f.read(&mut head))
        .ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next()?;
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let first = PathBuf::from(words.next()?);
    if first.file_name() == Some(OsStr::new("env")) {
        let name = words.find(|w| !w.starts_with('-'))?;
        which(Path::new(name), path_env)
    } else {
        Some(first)
    }
}

/// The directory to show for a program under a hidden path: for a file of an npm package, the
/// directory holding the outermost `node_modules` (the package needs its sibling packages:
/// Codex's launcher runs `@openai/codex-linux-x64`); else the parent of the nearest `bin`
/// directory above it (an install prefix: `…/venv/bin/aider` → `…/venv`), else its directory.
fn install_prefix(path: &Path, hidden: &[PathBuf]) -> Option<PathBuf> {
    let dir = path.parent()?;
    let npm = dir
        .ancestors()
        .filter(|a| a.file_name() == Some(OsStr::new("node_modules")))
        .last()
        .and_then(Path::parent);
    let prefix = npm
        .or_else(|| {
            dir.ancestors()
                .find(|a| a.file_name() == Some(OsStr::new("bin")))
                .and_then(Path::parent)
        })
        .unwrap_or(dir);
    // Never show a whole hidden root (HOME itself): the directory below it at most.
    match hidden.iter().find(|h| h.as_path() == prefix) {
        Some(_) => Some(dir.to_owned()),
        None => Some(prefix.to_owned()),
    }
}

/// The top directory below a hidden path that holds `dir` (`~/.pyenv` for `~/.pyenv/shims`);
/// for a path under a fresh directory, `dir` itself.
fn top_under(dir: &Path, hidden: &[PathBuf]) -> Option<PathBuf> {
    let root = hidden
        .iter()
        .filter(|h| dir.starts_with(h) && dir != h.as_path())
        .max_by_key(|h| depth(h))?;
    let below = dir.strip_prefix(root).ok()?.components().next()?;
    Some(root.join(below))
}

/// The `bwrap` command line (without the program) for `sandbox` running `program` with `args`
/// in `cwd`, the relays given.
fn bwrap_args(
    sandbox: &Sandbox,
    program: &Path,
    args: &[OsString],
    cwd: Option<&Path>,
    path_env: Option<&OsStr>,
    relays: &[(String, PathBuf)],
    socket_dir: Option<&Path>,
) -> Vec<OsString> {
    let mut out = base_args();
    if sandbox.network != Network::Host {
        out.push("--unshare-net".into());
    }
    let push = |out: &mut Vec<OsString>, words: &[&OsStr]| {
        out.extend(words.iter().map(|w| w.to_os_string()));
    };
    push(
        &mut out,
        &["--ro-bind".as_ref(), "/".as_ref(), "/".as_ref()],
    );
    push(&mut out, &["--dev".as_ref(), "/dev".as_ref()]);
    push(&mut out, &["--proc".as_ref(), "/proc".as_ref()]);
    push(&mut out, &["--tmpfs".as_ref(), "/tmp".as_ref()]);
    push(&mut out, &["--tmpfs".as_ref(), "/run".as_ref()]);
    if sandbox.network == Network::Host {
        // Name resolution may live under /run (systemd-resolved's stub).
        if let Ok(real) = std::fs::canonicalize("/etc/resolv.conf")
            && real.starts_with("/run")
        {
            push(
                &mut out,
                &["--ro-bind".as_ref(), real.as_os_str(), real.as_os_str()],
            );
        }
    }
    let mounts = mounts(sandbox, program, path_env);
    for m in &mounts {
        match m {
            Mount::Hide(p) if p.is_dir() => {
                push(&mut out, &["--tmpfs".as_ref(), p.as_os_str()]);
            }
            Mount::Hide(p) => {
                push(
                    &mut out,
                    &["--ro-bind".as_ref(), "/dev/null".as_ref(), p.as_os_str()],
                );
            }
            Mount::ReadOnly(p) => {
                push(
                    &mut out,
                    &["--ro-bind".as_ref(), p.as_os_str(), p.as_os_str()],
                );
            }
            Mount::Writable(p) => {
                push(&mut out, &["--bind".as_ref(), p.as_os_str(), p.as_os_str()]);
                // A worktree's `.git` file names its git directory: the run may not repoint it.
                let dotgit = p.join(".git");
                if std::fs::symlink_metadata(&dotgit).is_ok_and(|m| m.is_file()) {
                    push(
                        &mut out,
                        &["--ro-bind".as_ref(), dotgit.as_os_str(), dotgit.as_os_str()],
                    );
                }
            }
        }
    }
    if let Some(dir) = socket_dir {
        push(
            &mut out,
            &["--ro-bind".as_ref(), dir.as_os_str(), dir.as_os_str()],
        );
    }
    // A hidden directory is empty and read-only (after the mounts below it were made).
    for m in &mounts {
        if let Mount::Hide(p) = m
            && p.is_dir()
        {
            push(&mut out, &["--remount-ro".as_ref(), p.as_os_str()]);
        }
    }
    if let Some(dir) = cwd {
        push(&mut out, &["--chdir".as_ref(), dir.as_os_str()]);
    }
    out.push("--".into());
    if let (Some(init), false) = (&sandbox.init, relays.is_empty()) {
        out.push(init.program.clone().into_os_string());
        out.extend(init.args.iter().cloned());
        for (listen, socket) in relays {
            out.push("--relay".into());
            let mut spec = OsString::from(listen);
            spec.push("=");
            spec.push(socket);
            out.push(spec);
        }
        out.push("--".into());
    }
    out.push(program.as_os_str().to_owned());
    out.extend(args.iter().cloned());
    out
}

/// A sandbox made ready for one run: the bwrap command line, the relays' Unix sockets and
/// orch's side of them, the run's cgroup. Dropping it stops the relays, kills what is left in
/// the cgroup and removes it.
pub(crate) struct Prepared {
    /// bwrap's arguments (the program is [`Sandbox::bwrap`]).
    pub(crate) args: Vec<OsString>,
    _gate: Option<JoinSet<()>>,
    _socket_dir: Option<tempfile::TempDir>,
    pub(crate) cgroup: Option<Cgroup>,
}

impl Prepared {
    /// Sets up `sandbox` for `program args` in `cwd`; `path_env` is the `PATH` the run gets.
    pub(crate) async fn new(
        sandbox: &Sandbox,
        program: &Path,
        args: &[OsString],
        cwd: Option<&Path>,
        path_env: Option<&OsStr>,
        run_id: u64,
    ) -> io::Result<Prepared> {
        let mut relays: Vec<(String, PathBuf)> = Vec::new();
        let (gate, socket_dir) = match &sandbox.network {
            Network::Allow(endpoints) if !endpoints.is_empty() => {
                if sandbox.init.is_none() {
                    return Err(io::Error::other(
                        "the network allowlist needs orch's relay program, which is unknown",
                    ));
                }
                let dir = tempfile::Builder::new().prefix("orch-net-").tempdir()?;
                let mut set = JoinSet::new();
                let mut loopback: Vec<&Endpoint> =
                    endpoints.iter().filter(|e| e.is_loopback()).collect();
                loopback.sort();
                loopback.dedup_by(|a, b| listen_addr(a) == listen_addr(b));
                for (i, endpoint) in loopback.into_iter().enumerate() {
                    let socket = dir.path().join(format!("{i}.sock"));
                    let listener = UnixListener::bind(&socket)?;
                    let target = endpoint.clone();
                    set.spawn(forward(listener, target));
                    relays.push((listen_addr(endpoint), socket));
                }
                if endpoints.iter().any(|e| !e.is_loopback()) {
                    let socket = dir.path().join("proxy.sock");
                    let listener = UnixListener::bind(&socket)?;
                    set.spawn(proxy(listener, endpoints.clone()));
                    relays.push((format!("127.0.0.1:{}", proxy_port(endpoints)), socket));
                }
                (Some(set), Some(dir))
            }
            _ => (None, None),
        };
        let cgroup = Cgroup::create(run_id, &sandbox.limits);
        let args = bwrap_args(
            sandbox,
            program,
            args,
            cwd,
            path_env,
            &relays,
            socket_dir.as_ref().map(tempfile::TempDir::path),
        );
        Ok(Prepared {
            args,
            _gate: gate,
            _socket_dir: socket_dir,
            cgroup,
        })
    }
}

/// Passes every connection made to `listener` (inside the sandbox: the relay's) to `target`.
async fn forward(listener: UnixListener, target: Endpoint) {
    let mut conns = JoinSet::new();
    loop {
        let Ok((mut inside, _)) = listener.accept().await else {
            return;
        };
        let target = target.clone();
        conns.spawn(async move {
            match connect(&target).await {
                Ok(mut outside) => {
                    let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
                }
                Err(e) => {
                    tracing::debug!(%target, error = %e, "sandbox: cannot reach an allowed endpoint");
                }
            }
        });
        while conns.try_join_next().is_some() {}
    }
}

async fn connect(target: &Endpoint) -> io::Result<TcpStream> {
    let addr = (target.host.as_str(), target.port);
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connecting {target} timed out"),
        )),
    }
}

/// An HTTP `CONNECT` proxy that tunnels only to `allowed` endpoints and refuses (403) the rest.
async fn proxy(listener: UnixListener, allowed: Vec<Endpoint>) {
    let mut conns = JoinSet::new();
    loop {
        let Ok((inside, _)) = listener.accept().await else {
            return;
        };
        let allowed = allowed.clone();
        conns.spawn(async move {
            if let Err(e) = tunnel(inside, &allowed).await {
                tracing::debug!(error = %e, "sandbox proxy: connection ended with an error");
            }
        });
        while conns.try_join_next().is_some() {}
    }
}

async fn tunnel(mut inside: UnixStream, allowed: &[Endpoint]) -> io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let end = tokio::time::timeout(REQUEST_HEAD_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        loop {
            if let Some(i) = find(&head, b"\r\n\r\n") {
                return Ok(i + 4);
            }
            if head.len() > MAX_REQUEST_HEAD {
                return Err(io::Error::other("request head too long"));
            }
            let n = inside.read(&mut buf).await?;
            if n == 0 {
                return Err(io::Error::other("closed before the request head ended"));
            }
            head.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .map_err(|_| io::Error::other("request head timed out"))??;
    let line = String::from_utf8_lossy(&head[..find(&head, b"\r\n").unwrap_or(0)]).into_owned();
    let mut words = line.split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let refuse = |why: String| {
        format!(
            "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{why}",
            why.len()
        )
    };
    if !method.eq_ignore_ascii_case("CONNECT") {
        let why = format!(
            "orch sandbox: only CONNECT tunnels to the allowed endpoints are proxied, not `{method}`\n"
        );
        inside.write_all(refuse(why).as_bytes()).await?;
        return Ok(());
    }
    let endpoint = match Endpoint::parse(target) {
        Ok(e) if allowed.contains(&e) => e,
        _ => {
            tracing::warn!(target = %target, "sandbox: a connection outside the allowlist was refused");
            let why = format!("orch sandbox: {target} is not on this run's network allowlist\n");
            inside.write_all(refuse(why).as_bytes()).await?;
            return Ok(());
        }
    };
    let mut outside = match connect(&endpoint).await {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("orch sandbox: cannot reach {endpoint}: {e}\n");
            let resp = format!(
                "HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{msg}",
                msg.len()
            );
            inside.write_all(resp.as_bytes()).await?;
            return Ok(());
        }
    };
    inside
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await?;
    outside.write_all(&head[end..]).await?;
    tokio::io::copy_bidirectional(&mut inside, &mut outside).await?;
    Ok(())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A cgroup of one run: its processes and memory limited, everything in it killed when the run
/// ends. Made under orch's own cgroup when this machine lets orch write there (cgroup v2 with
/// the `pids`/`memory` controllers delegated, or the v1 hierarchies); `None` otherwise.
pub(crate) struct Cgroup {
    dirs: Vec<PathBuf>,
    /// `cgroup.procs` files the child writes itself into before it runs the program.
    pub(crate) procs: Vec<CString>,
}

impl Cgroup {
    fn create(run_id: u64, limits: &Limits) -> Option<Cgroup> {
        if limits.processes.is_none() && limits.memory_bytes.is_none() {
            return None;
        }
        let name = format!("orch-{}-{run_id}", std::process::id());
        let mut dirs = Vec::new();
        let mut writes: Vec<(PathBuf, String)> = Vec::new();
        if let Some(v2) = v2_parent() {
            let dir = v2.join(&name);
            if let Some(n) = limits.processes {
                writes.push((dir.join("pids.max"), n.to_string()));
            }
            if let Some(b) = limits.memory_bytes {
                writes.push((dir.join("memory.max"), b.to_string()));
                writes.push((dir.join("memory.swap.max"), "0".into()));
            }
            dirs.push(dir);
        } else {
            if let (Some(n), Some(root)) = (limits.processes, v1_parent("pids")) {
                let dir = root.join(&name);
                writes.push((dir.join("pids.max"), n.to_string()));
                dirs.push(dir);
            }
            if let (Some(b), Some(root)) = (limits.memory_bytes, v1_parent("memory")) {
                let dir = root.join(&name);
                writes.push((dir.join("memory.limit_in_bytes"), b.to_string()));
                dirs.push(dir);
            }
        }
        let mut made = Cgroup {
            dirs: Vec::new(),
            procs: Vec::new(),
        };
        for dir in &dirs {
            if std::fs::create_dir(dir).is_err() {
                return None; // dropping `made` removes what was made
            }
            made.dirs.push(dir.clone());
            let procs = CString::new(dir.join("cgroup.procs").as_os_str().as_bytes()).ok()?;
            made.procs.push(procs);
        }
        for (file, value) in writes {
            // memory.swap.max is absent without swap accounting: not a reason to give up.
            if let Err(e) = std::fs::write(&file, &value)
                && !file.ends_with("memory.swap.max")
            {
                tracing::debug!(file = %file.display(), error = %e, "cannot set a sandbox limit");
                return None;
            }
        }
        Some(made)
    }

    /// Kills every process still in the cgroup (bwrap's pid namespace normally took them all).
    fn kill_all(&self) {
        for dir in &self.dirs {
            if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    if pid > 1 {
                        // SAFETY: kill with a positive pid and a valid signal.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            }
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        self.kill_all();
        for dir in &self.dirs {
            // The kernel refuses while a killed process is still being torn down: try briefly.
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// orch's own cgroup in the v2 hierarchy, when it can hold child groups with `pids` and
/// `memory` (the controllers enabled for its children).
fn v2_parent() -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let root = mount_of("cgroup2")?;
    let dir = root.join(rel.trim_start_matches('/'));
    let enabled = std::fs::read_to_string(dir.join("cgroup.subtree_control")).ok()?;
    let has = |c: &str| enabled.split_whitespace().any(|w| w == c);
    (has("pids") && has("memory") && writable(&dir)).then_some(dir)
}

/// orch's own cgroup in the v1 hierarchy of `controller`, when orch may create groups in it.
fn v1_parent(controller: &str) -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, names, path) = (parts.next()?, parts.next()?, parts.next()?);
        names.split(',').any(|n| n == controller).then_some(path)
    })?;
    let root = v1_mount(controller)?;
    let dir = root.join(rel.trim_start_matches('/'));
    writable(&dir).then_some(dir)
}

fn writable(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: a valid NUL-terminated path and a mode constant.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

fn mount_of(fstype: &str) -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        let (_, dir, ty) = (w.next()?, w.next()?, w.next()?);
        (ty == fstype).then(|| PathBuf::from(dir))
    })
}

fn v1_mount(controller: &str) -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        let (_, dir, ty, opts) = (w.next()?, w.next()?, w.next()?, w.next()?);
        (ty == "cgroup" && opts.split(',').any(|o| o == controller)).then(|| PathBuf::from(dir))
    })
}

/// What a sandboxed run's limits come to on this machine, in words (for `orch doctor`).
pub fn limits_support() -> String {
    let procs = if v2_parent().is_some() {
        "processes and memory by a cgroup (v2)"
    } else if v1_parent("pids").is_some() && v1_parent("memory").is_some() {
        "processes and memory by a cgroup (v1)"
    } else if v1_parent("pids").is_some() {
        "processes by a cgroup (v1); memory not limited"
    } else {
        "no cgroup orch may write: processes by RLIMIT_NPROC only (not applied to root), memory not limited"
    };
    format!("{procs}; CPU time and file size by rlimits")
}

/// The rlimits a sandboxed child sets on itself before it runs bwrap, as
/// `(resource, value)` pairs.
pub(crate) fn rlimits(limits: &Limits) -> Vec<(libc::__rlimit_resource_t, u64)> {
    let mut out = Vec::new();
    if let Some(n) = limits.processes {
        out.push((libc::RLIMIT_NPROC, n));
    }
    if let Some(s) = limits.cpu_seconds {
        out.push((libc::RLIMIT_CPU, s));
    }
    if let Some(b) = limits.file_bytes {
        out.push((libc::RLIMIT_FSIZE, b));
    }
    out
}

/// The sandbox's first process when its network is an allowlist: `<relay options> --
/// <program> <args>`. For each `--relay <address>=<socket>` it listens on `address` (inside
/// the sandbox's network namespace) and passes each connection to the Unix socket, where orch
/// decides where it may go; then it runs the program and exits with its status. Returns the
/// exit code.
pub fn init_main(args: &[OsString]) -> i32 {
    let mut relays: Vec<(String, PathBuf)> = Vec::new();
    let mut rest = args.iter();
    let mut program: Vec<OsString> = Vec::new();
    while let Some(arg) = rest.next() {
        if arg == "--" {
            program = rest.cloned().collect();
            break;
        }
        if arg == "--relay"
            && let Some(spec) = rest.next()
            && let Some((addr, socket)) = spec.to_string_lossy().split_once('=')
        {
            relays.push((addr.to_owned(), PathBuf::from(socket)));
            continue;
        }
        eprintln!("orch sandbox relay: unexpected argument {arg:?}");
        return 125;
    }
    let Some((prog, prog_args)) = program.split_first() else {
        eprintln!("orch sandbox relay: no program to run");
        return 125;
    };
    for (addr, socket) in relays {
        let listener = match std::net::TcpListener::bind(&addr) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("orch sandbox relay: cannot listen on {addr}: {e}");
                return 125;
            }
        };
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let socket = socket.clone();
                std::thread::spawn(move || relay_one(conn, &socket));
            }
        });
    }
    // The one place a program is started outside `crate::process`: inside the sandbox, as its
    // first process, with the environment and stdio bwrap gave.
    match std::process::Command::new(prog).args(prog_args).status() {
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt as _;
            status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
        }
        Err(e) => {
            eprintln!("orch sandbox relay: cannot run {prog:?}: {e}");
            if e.kind() == io::ErrorKind::NotFound {
                127
            } else {
                126
            }
        }
    }
}

fn relay_one(tcp: std::net::TcpStream, socket: &Path) {
    let Ok(unix) = std::os::unix::net::UnixStream::connect(socket) else {
        return;
    };
    let (Ok(mut tcp_r), Ok(mut unix_r)) = (tcp.try_clone(), unix.try_clone()) else {
        return;
    };
    let (mut tcp_w, mut unix_w) = (tcp, unix);
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut tcp_r, &mut unix_w);
        let _ = unix_w.shutdown(std::net::Shutdown::Write);
    });
    let _ = io::copy(&mut unix_r, &mut tcp_w);
    let _ = tcp_w.flush();
    let _ = tcp_w.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxy_port_avoids_allowed_loopback_ports() {
        let e = |s: &str| Endpoint::parse(s).unwrap();
        assert_eq!(proxy_port(&[e("api.x.com:443")]), PROXY_PORT);
        assert_eq!(
            proxy_port(&[e("127.0.0.1:3128"), e("api.x.com:443")]),
            PROXY_PORT + 1
        );
    }

    #[test]
    fn deeper_rules_win_and_hidden_paths_stay_hidden_under_shown_ones() {
        let root = tempfile::tempdir().unwrap();
        let home = root.path().join("home");
        let tool = home.join(".tool");
        let state = tool.join("state");
        let work = home.join("repos/app/worktrees/A-1");
        for d in [&tool.join("bin"), &state, &work] {
            std::fs::create_dir_all(d).unwrap();
        }
        let sandbox = Sandbox {
            bwrap: "bwrap".into(),
            writable: vec![work.clone()],
            read_only: vec![],
            hidden: vec![home.clone(), state.clone()],
            network: Network::None,
            limits: Limits::default(),
            init: None,
        };
        let path_env = OsString::from(tool.join("bin"));
        let got = mounts(&sandbox, Path::new("sh"), Some(&path_env));
        let home = normal(&home).unwrap();
        let want = vec![
            Mount::Hide(home.clone()),
            Mount::ReadOnly(home.join(".tool")),
            Mount::Hide(home.join(".tool/state")),
            Mount::Writable(home.join("repos/app/worktrees/A-1")),
        ];
        // /tmp-based paths are under a fresh directory: only what exists matters here.
        if !home.starts_with("/tmp") {
            assert_eq!(got, want);
        } else {
            // Under /tmp the home is fresh already: no Hide of it, the rest the same.
            assert_eq!(got, want[1..].to_vec());
        }
    }
}
