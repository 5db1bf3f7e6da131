//! Configuration from environment variables (read once per `init`), documented in
//! `docs/nccl.md`. It owns parsing and defaults; it never opens anything.

use std::time::Duration;

use tbrdma_verbs::{EngineConfig, EngineKind, Progress};

use crate::error::NetError;

/// Links to use: comma-separated interface names or local IPv4 addresses.
pub const ENV_IFACES: &str = "TBRDMA_IFACES";
/// Engine backend: `sockets`, `packet` (Ethernet frames; root on every host, falls back to
/// sockets without the privilege) or `uring` (falls back to sockets); default: the fastest for
/// the progress mode ([`default_engine`]).
pub const ENV_ENGINE: &str = "TBRDMA_ENGINE";
/// Progress mode: `caller` (default: NCCL's calls run the engine, the keeper when NCCL stops
/// calling) or `thread` (an engine thread per link).
pub const ENV_PROGRESS: &str = "TBRDMA_PROGRESS";
/// Link speed to report to NCCL, in Mbit/s.
pub const ENV_SPEED: &str = "TBRDMA_SPEED_MBPS";
/// Latency to report to NCCL, in microseconds (0: NCCL's default).
pub const ENV_LATENCY: &str = "TBRDMA_LATENCY_US";
/// Longest connection setup, in milliseconds.
pub const ENV_CONNECT_TIMEOUT: &str = "TBRDMA_CONNECT_TIMEOUT_MS";

/// Progress mode when `TBRDMA_PROGRESS` is unset: the caller drives the engine while NCCL
/// polls, the keeper takes over when it stops (docs/nccl.md, "Progress", for the measurements).
pub const DEFAULT_PROGRESS: Progress = Progress::Caller;

/// Silence after which a connection with nothing outstanding counts its peer as dead, in
/// milliseconds (keep-alives go every sixth of it). Default 3000.
pub const ENV_IDLE_TIMEOUT: &str = "TBRDMA_IDLE_TIMEOUT_MS";

/// The engine backend when `TBRDMA_ENGINE` is unset: the fastest one measured for the progress
/// mode (`benches/src/bin/pluginbench.rs`, docs/nccl.md "Performance"). With caller progress,
/// the packet engine: the plugin's 8 B round trip took 0.74x the time it takes over sockets
/// (12.9 against 17.4 µs, same run) at the same bandwidth. Without root it falls back to
/// sockets (logged), and a link's packet engine sends UDP to the peers its frames cannot reach
/// (docs/verbs.md, "Frames where they reach, UDP elsewhere"), so hosts that differ still
/// connect. io_uring lost to sockets there: its ring cannot be single-issuer (NCCL's thread and the keeper both drive it) and each
/// receive completion interrupts the polling CPU. With an engine thread, the only user of its
/// ring, io_uring was faster than sockets on both counts.
pub fn default_engine(progress: Progress) -> EngineKind {
    match progress {
        Progress::Caller => EngineKind::Packet,
        Progress::Thread => EngineKind::Uring,
    }
}

/// Interface-name prefixes picked when `TBRDMA_IFACES` is unset.
pub const DEFAULT_PREFIXES: [&str; 2] = ["thunderbolt", "usb4"];

/// The plugin's settings.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// Links named by the user; empty: every interface whose name starts with a default prefix.
    pub links: Vec<String>,
    /// Engine settings of every device.
    pub engine: EngineConfig,
    /// Reported speed (Mbit/s); None: the interface's, else 20000.
    pub speed_mbps: Option<i32>,
    /// Reported latency (µs).
    pub latency_us: f32,
    /// Longest connection setup.
    pub connect_timeout: Duration,
    /// Silence after which an idle connection fails (None: the transport's default, 3 s).
    pub idle_timeout: Option<Duration>,
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, NetError> {
    value.trim().parse().map_err(|_| NetError::Config {
        detail: format!("{name}={value:?} is not a valid number"),
    })
}

impl PluginConfig {
    /// Reads the environment through `get` (`std::env::var` in production).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<PluginConfig, NetError> {
        let links = get(ENV_IFACES)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        let progress = match get(ENV_PROGRESS) {
            None => DEFAULT_PROGRESS,
            Some(v) => v
                .trim()
                .parse::<Progress>()
                .map_err(|detail| NetError::Config {
                    detail: format!("{ENV_PROGRESS}: {detail}"),
                })?,
        };
        let engine = match get(ENV_ENGINE).as_deref().map(str::trim) {
            None | Some("") => default_engine(progress),
            Some("uring") => EngineKind::Uring,
            Some("sockets") => EngineKind::Sockets,
            Some("packet") => EngineKind::Packet,
            Some(other) => {
                return Err(NetError::Config {
                    detail: format!(
                        "{ENV_ENGINE}={other:?}: use \"sockets\", \"packet\" or \"uring\""
                    ),
                });
            }
        };
        let speed_mbps = get(ENV_SPEED)
            .map(|v| parse::<i32>(ENV_SPEED, &v))
            .transpose()?;
        let latency_us = get(ENV_LATENCY)
            .map(|v| parse::<f32>(ENV_LATENCY, &v))
            .transpose()?
            .unwrap_or(0.0);
        let connect_timeout = Duration::from_millis(
            get(ENV_CONNECT_TIMEOUT)
                .map(|v| parse::<u64>(ENV_CONNECT_TIMEOUT, &v))
                .transpose()?
                .unwrap_or(10_000),
        );
        let idle_timeout = get(ENV_IDLE_TIMEOUT)
            .map(|v| parse::<u64>(ENV_IDLE_TIMEOUT, &v))
            .transpose()?
            .map(|ms| Duration::from_millis(ms.max(1)));
        Ok(PluginConfig {
            idle_timeout,
            links,
            engine: EngineConfig {
                engine,
                progress,
                // NCCL's proxy thread stops calling between collectives: the keeper then runs
                // the engine, so idle connections live and dead peers are noticed.
                keeper_takeover: true,
                ..EngineConfig::default()
            },
            speed_mbps,
            latency_us,
            connect_timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn defaults_pick_caller_progress_with_the_keeper_taking_over_and_the_packet_engine() {
        let c = PluginConfig::from_env(env(&[])).unwrap();
        assert!(c.links.is_empty());
        assert_eq!(c.engine.progress, Progress::Caller);
        assert!(c.engine.keeper_takeover);
        assert_eq!(c.engine.engine, EngineKind::Packet);
        let t = PluginConfig::from_env(env(&[(ENV_PROGRESS, "thread")])).unwrap();
        assert_eq!(t.engine.engine, EngineKind::Uring);
        assert_eq!(c.speed_mbps, None);
    }

    #[test]
    fn every_variable_is_read() {
        let c = PluginConfig::from_env(env(&[
            (ENV_IFACES, "thunderbolt0, 10.0.0.1,"),
            (ENV_ENGINE, "packet"),
            (ENV_PROGRESS, "caller"),
            (ENV_SPEED, "40000"),
            (ENV_LATENCY, "12.5"),
            (ENV_CONNECT_TIMEOUT, "250"),
        ]))
        .unwrap();
        assert_eq!(c.links, ["thunderbolt0", "10.0.0.1"]);
        assert_eq!(c.engine.engine, EngineKind::Packet);
        assert_eq!(c.engine.progress, Progress::Caller);
        assert_eq!(c.speed_mbps, Some(40000));
        assert_eq!(c.latency_us, 12.5);
        assert_eq!(c.connect_timeout, Duration::from_millis(250));
        for kind in [EngineKind::Sockets, EngineKind::Packet, EngineKind::Uring] {
            let c = PluginConfig::from_env(env(&[(ENV_ENGINE, kind.name())])).unwrap();
            assert_eq!(c.engine.engine, kind);
        }
    }

    #[test]
    fn bad_values_are_refused_with_the_variable_named() {
        for (k, v) in [
            (ENV_ENGINE, "dpdk"),
            (ENV_PROGRESS, "never"),
            (ENV_SPEED, "fast"),
        ] {
            let e = PluginConfig::from_env(env(&[(k, v)])).unwrap_err();
            assert!(e.to_string().contains(k), "{e}");
        }
    }
}
