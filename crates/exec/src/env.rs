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
            !NEVER.contains(&k) && (is_base(k) || extra.iter().any(|e| e == k))
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
