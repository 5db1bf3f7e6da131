//! # tbrdma-collectives (being written)
