//! # libtbrdma (being written)
