//! (being written: see the next commits)
