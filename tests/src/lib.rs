//! Multi-process tests of tbrdma over real sockets between network namespaces live here
//! (`tests/`); this library holds what they share. Tests of a single binary's command line
//! live beside that binary (`cli/tests/`), where Cargo hands them the binary's path.
