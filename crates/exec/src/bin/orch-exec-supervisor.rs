//! The supervisor on its own ([`orch_exec::supervise::main`]), for this crate's tests: orch
//! itself runs its own binary with `__supervise` instead.

fn main() {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == orch_exec::supervise::ARG) {
        args.remove(0);
    }
    std::process::exit(orch_exec::supervise::main(&args));
}
