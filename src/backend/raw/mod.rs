//! Building blocks shared by the adapters, below any one storage protocol.

pub mod compressed;
pub mod count_cache;
pub mod http;
pub mod layer;
pub mod sharded;
