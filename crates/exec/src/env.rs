//! What a child of orch inherits from orch's environment: an allowlist, never the whole of it.
//! orch's own environment holds its API token, its database URL with a password, every agent's
//! API key, cloud credentials and an ssh agent socket; a child gets only the variables a
//! program needs to run ([`BASE`]: where programs are, language, time zone, and the variables
//! toolchains locate themselves by) and what its caller names for it (an agent's own key, the
//! variables a repo's configuration names for its commands, git's ssh agent).

use std::ffi::OsString;

/// Variables every child may inherit: not secrets, needed to find and run programs.
pub const BASE: [&str; 26] = [
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "TMPDIR",
    "PYENV_ROOT",
    "PYENV_VERSION",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "CARGO_HOME",
    "RUSTUP_HOME",
    "RUSTUP_TOOLCHAIN",
    "GOPATH",
    "GOROOT",
    "GOTOOLCHAIN",
    "JAVA_HOME",
    "NVM_DIR",
    "NODE_PATH",
    "NODE_EXTRA_CA_CERTS",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
];

/// Prefixes of variables every child may inherit (the locale's `LC_*`).
pub const BASE_PREFIXES: [&str; 1] = ["LC_"];

/// Variables orch never passes to a child, whatever a configuration names: orch's own token
/// and database URLs.
pub const NEVER: [&str; 4] = orch_domain::net::SECRET_VARS;

/// Variables the configuration names as holding secrets (a forge's token and webhook secret),
/// kept, like [`NEVER`], out of every child's environment: see [`treat_as_secret`].
static CONFIGURED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Records that variables `names` hold secrets the configuration uses: from then on no child
/// gets them, the supervisor of a stage's command included (which otherwise starts with orch's
/// whole environment, readable through its `/proc/<pid>/environ`). Called for every
/// configuration read, first and reloaded; names are only ever added.
pub fn treat_as_secret<'a>(names: impl IntoIterator<Item = &'a str>) {
    let mut known = CONFIGURED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for name in names {
        if !name.is_empty() && !known.iter().any(|k| k == name) {
            known.push(name.to_owned());
        }
    }
}

/// Whether `name` is [`NEVER`] or named by the configuration as a secret.
pub fn is_secret(name: &str) -> bool {
    NEVER.contains(&name)
        || CONFIGURED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .any(|k| k == name)
}

/// Every variable of orch's environment that [`is_secret`].
pub fn secrets_present() -> Vec<OsString> {
    std::env::vars_os()
        .filter_map(|(k, _)| k.to_str().is_some_and(is_secret).then_some(k))
        .collect()
}

/// Whether `name` is in [`BASE`] or starts with one of [`BASE_PREFIXES`].
pub fn is_base(name: &str) -> bool {
    BASE.contains(&name) || BASE_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The variables of orch's environment a child gets: [`BASE`] and `extra`, minus [`NEVER`].
pub fn allowed(extra: &[String]) -> Vec<(OsString, OsString)> {
    std::env::vars_os()
        .filter(|(k, _)| {
            let Some(k) = k.to_str() else {
                return false;
            };
            !is_secret(k) && (is_base(k) || extra.iter().any(|e| e == k))
        })
        .collect()
}

/// Removes `names` from orch's own environment and overwrites their values in the memory the
/// kernel shows as `/proc/<pid>/environ` (removing a variable alone leaves its text there), then
/// marks the process non-dumpable so other processes of its user cannot read its memory or
/// environment through `/proc`. Returns the values removed, for orch to keep in memory.
///
/// # Safety
/// Call before any other thread exists (the first thing `main` does): it writes to the
/// process's environment.
pub unsafe fn take_from_own_environment(names: &[&str]) -> Vec<(String, String)> {
    let mut taken = Vec::new();
    for name in names {
        if let Some(value) = std::env::var_os(name) {
            taken.push(((*name).to_owned(), value.to_string_lossy().into_owned()));
        }
    }
    if taken.is_empty() {
        // Still not readable by other processes of its user: a secret the configuration names
        // (a forge's token) is in the environment too, and the config is read later.
        // SAFETY: prctl with plain integers.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
        return taken;
    }
    unsafe extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    // SAFETY: single-threaded (the caller's contract); `environ` is the C library's array of
    // NUL-terminated strings, each walked only up to its terminator.
    unsafe {
        let mut entry = environ;
        while !entry.is_null() && !(*entry).is_null() {
            let text = *entry;
            let len = libc::strlen(text);
            let bytes = std::slice::from_raw_parts_mut(text.cast::<u8>(), len);
            if let Some(eq) = bytes.iter().position(|b| *b == b'=') {
                let key = &bytes[..eq];
                if names.iter().any(|n| n.as_bytes() == key) {
                    for b in &mut bytes[eq + 1..] {
                        *b = b'x';
                    }
                }
            }
            entry = entry.add(1);
        }
        for (name, _) in &taken {
            std::env::remove_var(name);
        }
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
    taken
}
