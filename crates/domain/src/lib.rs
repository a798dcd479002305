//! placeholder
pub mod monitor;
pub mod staging;
