mod parsers;
#[cfg(feature = "serde")]
mod serde;
mod types;

pub use self::types::*;
