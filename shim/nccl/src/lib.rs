//! # NCCL/RCCL net plugin (being written)
