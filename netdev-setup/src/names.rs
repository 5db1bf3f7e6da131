//! Names read from files and command lines (links files, hostfiles, discovery records) that end
//! up in paths, config files, netlink requests or environment files written by root tools: the
//! one place that decides which are acceptable, checked when a file is loaded and again where a
//! name is joined into a path or a file.
//!
//! The rules are stricter than the kernel's (which allows almost any byte in an interface name)
//! so that a name is always safe as a path component, inside a quoted udev match, as a
//! systemd-networkd `Name=` (where `*` and `?` are patterns) and in a shell-sourced file.

use crate::error::{NetdevError, Result};

/// Longest interface name Linux accepts (IFNAMSIZ minus the terminating NUL).
pub const MAX_INTERFACE_NAME: usize = 15;

/// Longest host name (a DNS name's limit).
pub const MAX_HOST_NAME: usize = 253;

/// Checks an interface name: 1 to 15 characters from `A-Z a-z 0-9 - _ . @ +`, not `.` or `..`.
pub fn check_interface_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_INTERFACE_NAME
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@' | '+'));
    if ok {
        Ok(())
    } else {
        Err(NetdevError::bad_input(
            format!("interface name {name:?} is not usable"),
            "name a network interface as `ip link` shows it: 1-15 characters from A-Z, a-z, \
             0-9 and - _ . @ +",
        ))
    }
}

/// Checks a host name or host UUID from a file: 1 to 253 characters from `A-Z a-z 0-9 - _ .`.
pub fn check_host_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_HOST_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(NetdevError::bad_input(
            format!("{what} {name:?} is not usable"),
            "use 1-253 characters from A-Z, a-z, 0-9 and - _ .",
        ))
    }
}

/// Largest links file or hostfile read (a real one is a few KiB): a bigger file is refused
/// before it is read whole.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Reads a small text file (links file, hostfile), refusing one over [`MAX_FILE_BYTES`].
pub fn read_small_file(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| NetdevError::io("reading", path, e))?;
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| NetdevError::io("reading", path, e))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(NetdevError::bad_input(
            format!("{} is larger than {MAX_FILE_BYTES} bytes", path.display()),
            "point the option at the links file or hostfile tbrdma wrote",
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_that_could_escape_a_path_or_a_file_are_refused() {
        for good in [
            "thunderbolt0",
            "tbl-p1-0",
            "enp1s0f1",
            "veth.12",
            "a",
            "x@y+z_1",
        ] {
            assert!(check_interface_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../../etc/x",
            "a/b",
            "sixteen-chars-xx",
            "eth0\n[Network]",
            "eth0\"",
            "eth*",
            "eth?",
            "a b",
            "$(reboot)",
            "thunderbolt0;",
            "é",
        ] {
            let err = check_interface_name(bad).expect_err(bad).to_string();
            assert!(err.contains("not usable"), "{bad}: {err}");
        }
    }

    #[test]
    fn host_names_are_plain() {
        assert!(check_host_name("host", "strix-1.lan").is_ok());
        assert!(check_host_name("uuid", "0123abcd-0000-4000-8000-000000000001").is_ok());
        for bad in ["", "a b", "x;rm -rf /", "h\nNCCL_NET=Socket", "../x", "'q'"] {
            assert!(check_host_name("host", bad).is_err(), "{bad:?}");
        }
        assert!(check_host_name("host", &"a".repeat(254)).is_err());
    }

    #[test]
    fn oversized_files_are_refused_before_being_read() {
        let path = std::env::temp_dir().join(format!("tbrdma-big-{}", std::process::id()));
        std::fs::write(&path, vec![b' '; MAX_FILE_BYTES as usize + 1]).unwrap();
        let err = read_small_file(&path).unwrap_err().to_string();
        assert!(err.contains("larger than"), "{err}");
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(read_small_file(&path).unwrap(), "{}");
        let _ = std::fs::remove_file(&path);
    }
}
