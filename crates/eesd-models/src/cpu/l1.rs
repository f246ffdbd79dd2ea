//! The size of the level-1 data cache, read once: the f32 kernel prefetches the next chunk of
//! weights into L1 only where it fits there beside the chunk being read.

use std::sync::OnceLock;

/// Assumed where the OS does not say (the smallest L1d of the x86-64 cores this project met).
const FALLBACK: usize = 32 * 1024;

/// Bytes of level-1 data cache per core: Linux's `/sys/devices/system/cpu/cpu0/cache`
/// (the level-1 entry of type `Data`), else 32 KiB. `EESD_L1D_BYTES` overrides it (to compare
/// prefetch strategies on one machine).
pub(crate) fn l1_data_bytes() -> usize {
    static BYTES: OnceLock<usize> = OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("EESD_L1D_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .or_else(from_sysfs)
            .unwrap_or(FALLBACK)
    })
}

/// The level-1 data cache's size as Linux reports it (`"48K"`).
fn from_sysfs() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let read = |name: &str| std::fs::read_to_string(entry.path().join(name)).ok();
        let (Some(level), Some(kind)) = (read("level"), read("type")) else {
            continue;
        };
        if level.trim() == "1" && kind.trim() == "Data" {
            return parse_size(read("size")?.trim());
        }
    }
    None
}

/// `"48K"`, `"1M"` or a plain byte count as bytes.
fn parse_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => Some(n * 1024),
        "M" => Some(n * 1024 * 1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_linux_writes_them() {
        assert_eq!(parse_size("48K"), Some(48 * 1024));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("32768"), Some(32768));
        assert_eq!(parse_size("K"), None);
        assert_eq!(parse_size("12Q"), None);
    }

    #[test]
    fn the_size_is_plausible() {
        let bytes = l1_data_bytes();
        assert!((4 * 1024..=4 << 20).contains(&bytes), "{bytes}");
    }
}
