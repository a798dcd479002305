//! The sandbox relay on its own ([`orch_exec::sandbox::init_main`]), for this crate's tests:
//! orch itself runs its own binary with `__sandbox-init` instead.

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    std::process::exit(orch_exec::sandbox::init_main(&args));
}
