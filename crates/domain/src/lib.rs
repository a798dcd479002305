//! placeholder
pub mod staging;
