//! Loads `orch.toml` (the domain crate owns its grammar) and the API token.

pub const DEFAULT_TOML: &str = "# orch configuration\n[settings]\n";
