//! Which build this is: the crate's version, the git commit and whether the tree had uncommitted changes, as
//! build.rs recorded them. Shown by `gpu-dra --version`, logged at start and exported as `gpu_dra_build_info`, so
//! that an operator can tell two builds of one version apart (a patched image, a build from a dirty tree).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Cargo.toml's version: the one source of the chart's `version` and `appVersion` and the image tag.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit the binary was built from (12 hex digits), or `unknown` (no git checkout, see build.rs).
pub const COMMIT: &str = env!("GPU_DRA_GIT_COMMIT");
/// `true` when tracked files differed from [`COMMIT`] at build time, `false` when not, `unknown` without git.
pub const DIRTY: &str = env!("GPU_DRA_GIT_DIRTY");
/// What `gpu-dra --version` prints after the program name.
pub const LONG_VERSION: &str =
    concat!(env!("CARGO_PKG_VERSION"), " commit=", env!("GPU_DRA_GIT_COMMIT"), " dirty=", env!("GPU_DRA_GIT_DIRTY"));

/// Adds `gpu_dra_build_info{version, commit, dirty} 1` to `registry` (the Prometheus `*_build_info` convention: join on
/// it to label any series with the build).
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(BuildInfo));
}

/// Logs the build once at start, with the component's name.
pub fn log_start(component: &str) {
    tracing::info!(component, version = VERSION, commit = COMMIT, dirty = DIRTY, "starting gpu-dra");
}

#[derive(Debug)]
struct BuildInfo;

impl Collector for BuildInfo {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let family = Family::<[(&str, &str); 3], Gauge>::default();
        family.get_or_create(&[("version", VERSION), ("commit", COMMIT), ("dirty", DIRTY)]).set(1);
        family.encode(encoder.encode_descriptor(
            "gpu_dra_build_info",
            "The gpu-dra build: its version, git commit and whether the tree had uncommitted changes (unknown when built without git); always 1.",
            None,
            MetricType::Gauge,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_one_build_info_sample() -> Result<(), std::fmt::Error> {
        let mut registry = Registry::default();
        register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry)?;
        let sample = format!("gpu_dra_build_info{{version=\"{VERSION}\",commit=\"{COMMIT}\",dirty=\"{DIRTY}\"}} 1\n");
        assert!(text.contains(&sample), "{text}");
        assert!(text.contains("# TYPE gpu_dra_build_info gauge"), "{text}");
        Ok(())
    }

    #[test]
    fn commit_and_dirty_are_known_or_say_unknown() {
        assert!(COMMIT == "unknown" || (COMMIT.len() == 12 && COMMIT.bytes().all(|b| b.is_ascii_hexdigit())));
        assert!(["true", "false", "unknown"].contains(&DIRTY), "{DIRTY}");
        assert_eq!(LONG_VERSION, format!("{VERSION} commit={COMMIT} dirty={DIRTY}"));
    }
}
