//! Where a running orch keeps its files: resolved once from the project root and the config
//! (`Context::places`) at start-up and handed down, so nothing the start-up builds asks the
//! command-line context again.

use std::path::{Path, PathBuf};

use orch_domain::config::Config;

/// The directories and files of one project, as a running process uses them.
#[derive(Debug, Clone)]
pub struct Places {
    /// The directory holding `orch.toml` and `.orch/`.
    pub root: PathBuf,
    pub config_path: PathBuf,
    /// `.orch/` under the root.
    pub state_dir: PathBuf,
    /// `settings.repos_dir`, resolved against the root (a restart applies a change).
    pub repos_dir: PathBuf,
    /// The SQLite database's directory, when the database is SQLite.
    pub database_dir: Option<PathBuf>,
}

impl Places {
    /// Where this node's orch processes record the process groups they start.
    pub fn children_dir(&self) -> PathBuf {
        self.repos_dir.join(".orch-children")
    }

    /// orch's own files and directories no sandboxed run may see under `config`: the
    /// configuration file, the state directory, the database's directory, the repos directory
    /// and every repo's local checkout or bare repository. Handed to the runner at start-up and
    /// after a reload (`orch_runner::contain::protect`).
    pub fn protected(&self, config: &Config) -> Vec<PathBuf> {
        let mut paths = vec![
            self.config_path.clone(),
            self.state_dir.clone(),
            self.repos_dir.clone(),
        ];
        paths.extend(self.database_dir.clone());
        for repo in config.repos.values() {
            if let Some(p) = &repo.path {
                let p = Path::new(p);
                paths.push(if p.is_absolute() {
                    p.to_path_buf()
                } else {
                    self.root.join(p)
                });
            }
        }
        paths
    }
}

/// This machine's node name: `settings.node`, else the host name.
pub fn node_name(config: &Config) -> String {
    config.settings.node.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".to_owned())
    })
}
