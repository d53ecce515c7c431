//! `GpuConfig`: the driver's opaque device configuration, carried in DeviceClasses and ResourceClaims as
//! `opaque: {driver: <driver>, parameters: {apiVersion: <driver>/v1alpha1, kind: GpuConfig, …}}`.
//!
//! NVIDIA's spelling is accepted too (`apiVersion: resource.nvidia.com/v1beta1`, `kind: GpuConfig`, `sharing.strategy`,
//! `sharing.timeSlicingConfig.interval`, `sharing.mpsConfig`; `kind: MigDeviceConfig` for MIG devices), so claims
//! written for NVIDIA's DRA driver work once the driver and class names are swapped.
//!
//! Decoding is strict (an unknown or misspelt field is an error naming it, never silently ignored), then
//! validated; configuration from the class applies first, then the claim's (the claim wins), each to the requests it
//! names (none = all). Errors refuse the claim at NodePrepareResources with a message the pod's events show.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The version of `GpuConfig` this agent understands, under the driver's own domain.
pub const GPU_CONFIG_VERSION: &str = "v1alpha1";
pub const GPU_CONFIG_KIND: &str = "GpuConfig";
/// NVIDIA's DRA driver's configuration API, accepted as an alternative spelling.
pub const NVIDIA_CONFIG_API_VERSION: &str = "resource.nvidia.com/v1beta1";
/// NVIDIA's configuration of MIG devices.
pub const NVIDIA_MIG_CONFIG_KIND: &str = "MigDeviceConfig";

/// How the GPUs of one request are prepared.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    /// How several containers share the claim's GPUs.
    #[serde(default)]
    pub sharing: Sharing,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Sharing {
    #[serde(default)]
    pub strategy: SharingStrategy,
    /// Only with `strategy: TimeSlicing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<TimeSlicing>,
    /// Only with `strategy: MPS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsConfig>,
}

/// `Exclusive`: the GPU's scheduling between the processes of the containers that share the claim left as it is.
/// `TimeSlicing`: the GPU's time slice set to `timeSlicing.interval` while the claim is prepared (see
/// [`super::time_slice`]). `MPS`: an MPS control daemon runs for the claim while it is prepared, and its containers
/// are clients of it (see [`super::mps`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SharingStrategy {
    #[default]
    Exclusive,
    TimeSlicing,
    #[serde(rename = "MPS")]
    Mps,
}

/// The limits an MPS claim's clients run under; NVIDIA's `mpsConfig` has the same fields. Limits are Kubernetes
/// memory quantities (`10Gi`, `512Mi`); the per-device map is keyed by a device's UUID or by its index among the
/// claim's devices sorted by UUID (NVIDIA's rule), and overrides the default for that device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsConfig {
    /// The share of each GPU's threads a client may use, 1 to 100 (the daemon's default is 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_active_thread_percentage: Option<i64>,
    /// The device memory each client may pin, on every device of the claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_pinned_device_memory_limit: Option<Quantity>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub default_per_device_pinned_memory_limit: BTreeMap<String, Quantity>,
}

/// A Kubernetes quantity as written: a string (`10Gi`) or, as Kubernetes also accepts, a bare JSON number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Quantity(pub String);

impl From<&str> for Quantity {
    fn from(text: &str) -> Self {
        Self(text.to_string())
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = Quantity;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a quantity such as \"10Gi\" or a number of bytes")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Quantity, E> {
                Ok(Quantity(text.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, number: u64) -> Result<Quantity, E> {
                Ok(Quantity(number.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, number: i64) -> Result<Quantity, E> {
                Ok(Quantity(number.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, number: f64) -> Result<Quantity, E> {
                Ok(Quantity(number.to_string()))
            }
        }
        deserializer.deserialize_any(Text)
    }
}

/// Below this a pinned memory limit is refused (NVIDIA's rule): MPS takes limits in whole MiB.
pub const MIB: u64 = 1 << 20;

impl MpsConfig {
    /// Checks the values; `path` names the object in errors (`sharing.mps`, or NVIDIA's `sharing.mpsConfig`).
    fn check(&self, path: &str) -> Result<(), String> {
        if let Some(percentage) = self.default_active_thread_percentage
            && !(1..=100).contains(&percentage)
        {
            return Err(format!(
                "{path}.defaultActiveThreadPercentage: {percentage} is not a percentage of a GPU's threads from 1 to 100"
            ));
        }
        if let Some(limit) = &self.default_pinned_device_memory_limit {
            pinned_limit_mib(&limit.0).map_err(|e| format!("{path}.defaultPinnedDeviceMemoryLimit: {e}"))?;
        }
        for (device, limit) in &self.default_per_device_pinned_memory_limit {
            if device.is_empty() {
                return Err(format!(
                    "{path}.defaultPerDevicePinnedMemoryLimit: an empty key; name a device by its UUID or index"
                ));
            }
            pinned_limit_mib(&limit.0)
                .map_err(|e| format!("{path}.defaultPerDevicePinnedMemoryLimit[{device:?}]: {e}"))?;
        }
        Ok(())
    }
}

/// A pinned memory limit in whole MiB (rounded down, as NVIDIA's driver does), at least 1 MiB.
pub fn pinned_limit_mib(quantity: &str) -> Result<u64, String> {
    let bytes = memory_bytes(quantity)?;
    if bytes < MIB {
        return Err(format!("{quantity:?} is below 1Mi, the smallest limit MPS takes"));
    }
    Ok(bytes / MIB)
}

/// A Kubernetes memory quantity in whole bytes, rounded up as upstream's `Quantity.Value()` does: an optional `+`, a
/// number (decimals allowed), and a binary (`Ki` … `Ei`), decimal (`n`, `u`, `m`, `k`, `M` … `E`) or exponent
/// (`e9`, `E-3`) suffix. The exponent form is how the API server writes back a quantity given as one
/// (`memory: 10e9` in a claim's capacity request is `1e10` in its allocation's `consumedCapacity`).
pub fn memory_bytes(quantity: &str) -> Result<u64, String> {
    let invalid = || format!("{quantity:?} is not a memory quantity such as 10Gi, 512Mi or 1G");
    let unsigned = quantity.strip_prefix('+').unwrap_or(quantity);
    let split = unsigned.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(unsigned.len());
    let (number, suffix) = unsigned.split_at(split);
    // The suffix as a power of two and a power of ten.
    let (two, ten): (u32, i32) = match suffix {
        "" => (0, 0),
        "n" => (0, -9),
        "u" => (0, -6),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        exponent => {
            let power = exponent.strip_prefix(['e', 'E']).and_then(|p| p.parse::<i32>().ok());
            (0, power.filter(|p| p.unsigned_abs() <= 40).ok_or_else(invalid)?)
        }
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(invalid());
    }
    let digits: u128 = format!("{whole}{fraction}").parse().map_err(|_| invalid())?;
    let scale = u32::try_from(fraction.len()).map_err(|_| invalid())? + ten.min(0).unsigned_abs();
    let numerator = digits
        .checked_mul(1u128 << two)
        .and_then(|n| n.checked_mul(10u128.checked_pow(ten.max(0).unsigned_abs())?))
        .ok_or_else(invalid)?;
    let denominator = 10u128.checked_pow(scale).ok_or_else(invalid)?;
    u64::try_from(numerator.div_ceil(denominator)).map_err(|_| invalid())
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TimeSlicing {
    #[serde(default)]
    pub interval: TimeSliceInterval,
}

/// The time-slice lengths NVIDIA's compute policy offers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeSliceInterval {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

/// The envelope every opaque parameter object has.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
}

/// The document as users write it: type metadata plus the config's fields, every other field refused. (Not
/// `#[serde(flatten)]`: it would lose the path to the offending field.)
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Document {
    #[allow(dead_code)]
    api_version: String,
    #[allow(dead_code)]
    kind: String,
    #[serde(default)]
    sharing: Sharing,
}

/// Control characters (line breaks, terminal escapes), the Unicode line and paragraph separators, and the marks
/// and overrides of text direction (bidirectional text: what makes `a.gpu` read as another name).
fn reshapes_text(c: char) -> bool {
    const SEPARATORS: [char; 2] = ['\u{2028}', '\u{2029}'];
    const DIRECTION_MARKS: [char; 2] = ['\u{200e}', '\u{200f}'];
    c.is_control()
        || SEPARATORS.contains(&c)
        || DIRECTION_MARKS.contains(&c)
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

impl GpuConfig {
    /// Decodes and validates one opaque parameter object for `driver`. The error names the offending field, with
    /// the characters that reshape text escaped: serde repeats a field name as the tenant wrote it, and the error
    /// goes to the agent's log, where a line break would begin a line of the tenant's making, and to the pod's
    /// Events, where a direction override would show the text reordered.
    pub fn decode(driver: &str, parameters: &serde_json::Value) -> Result<GpuConfig, String> {
        Self::decode_as_written(driver, parameters).map_err(|error| {
            error.chars().flat_map(|c| if reshapes_text(c) { c.escape_default().collect() } else { vec![c] }).collect()
        })
    }

    fn decode_as_written(driver: &str, parameters: &serde_json::Value) -> Result<GpuConfig, String> {
        let meta =
            TypeMeta::deserialize(parameters).map_err(|e| format!("not an object with apiVersion and kind: {e}"))?;
        let expected = format!("{driver}/{GPU_CONFIG_VERSION}");
        let config = match (meta.api_version.as_str(), meta.kind.as_str()) {
            (version, GPU_CONFIG_KIND) if version == expected => {
                let document: Document = strict(parameters)?;
                GpuConfig { sharing: document.sharing }
            }
            (NVIDIA_CONFIG_API_VERSION, GPU_CONFIG_KIND) => strict::<NvidiaDocument>(parameters)?.into_config()?,
            (NVIDIA_CONFIG_API_VERSION, NVIDIA_MIG_CONFIG_KIND) => {
                strict::<NvidiaMigDocument>(parameters)?.into_config()?
            }
            (version, kind) => {
                return Err(format!(
                    "apiVersion {version:?}, kind {kind:?}: this driver understands apiVersion {expected:?} (or \
                     NVIDIA's {NVIDIA_CONFIG_API_VERSION:?}), kind {GPU_CONFIG_KIND:?}"
                ));
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// Rules the types alone cannot express.
    pub fn validate(&self) -> Result<(), String> {
        let sharing = &self.sharing;
        if sharing.time_slicing.is_some() && sharing.strategy != SharingStrategy::TimeSlicing {
            return Err("sharing.timeSlicing: only allowed with sharing.strategy TimeSlicing".to_string());
        }
        match &sharing.mps {
            Some(_) if sharing.strategy != SharingStrategy::Mps => {
                Err("sharing.mps: only allowed with sharing.strategy MPS".to_string())
            }
            Some(mps) => mps.check("sharing.mps"),
            None => Ok(()),
        }
    }
}

/// Decodes `value` as `T`, every unknown field refused; the error names the path to the offending field.
fn strict<T: serde::de::DeserializeOwned>(value: &serde_json::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        if path == "." { e.inner().to_string() } else { format!("{path}: {}", e.inner()) }
    })
}

/// NVIDIA's `GpuConfig` (`resource.nvidia.com/v1beta1`), field for field.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaDocument {
    #[allow(dead_code)]
    api_version: String,
    #[allow(dead_code)]
    kind: String,
    #[serde(default)]
    sharing: Option<NvidiaSharing>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaSharing {
    strategy: NvidiaStrategy,
    #[serde(default)]
    time_slicing_config: Option<NvidiaTimeSlicing>,
    #[serde(default)]
    mps_config: Option<MpsConfig>,
}

#[derive(Clone, Copy, Deserialize)]
enum NvidiaStrategy {
    TimeSlicing,
    #[serde(rename = "MPS")]
    Mps,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaTimeSlicing {
    #[serde(default)]
    interval: TimeSliceInterval,
}

impl NvidiaDocument {
    /// This driver's model of the same configuration, with NVIDIA's own rules (a strategy's config only with that
    /// strategy).
    fn into_config(self) -> Result<GpuConfig, String> {
        let Some(sharing) = self.sharing else { return Ok(GpuConfig::default()) };
        match (sharing.strategy, sharing.time_slicing_config, sharing.mps_config) {
            (NvidiaStrategy::TimeSlicing, _, Some(_)) => {
                Err("sharing.mpsConfig: only allowed with sharing.strategy MPS".into())
            }
            (NvidiaStrategy::TimeSlicing, time_slicing, None) => Ok(GpuConfig {
                sharing: Sharing {
                    strategy: SharingStrategy::TimeSlicing,
                    time_slicing: Some(TimeSlicing { interval: time_slicing.map(|t| t.interval).unwrap_or_default() }),
                    mps: None,
                },
            }),
            (NvidiaStrategy::Mps, Some(_), _) => {
                Err("sharing.timeSlicingConfig: only allowed with sharing.strategy TimeSlicing".into())
            }
            (NvidiaStrategy::Mps, None, mps) => mps_config(mps),
        }
    }
}

/// NVIDIA's `MigDeviceConfig`, field for field: MIG devices have no time slice of their own (NVIDIA's API has no
/// `timeSlicingConfig` here), so `TimeSlicing` leaves the device as it is.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaMigDocument {
    #[allow(dead_code)]
    api_version: String,
    #[allow(dead_code)]
    kind: String,
    #[serde(default)]
    sharing: Option<NvidiaMigSharing>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NvidiaMigSharing {
    strategy: NvidiaStrategy,
    #[serde(default)]
    mps_config: Option<MpsConfig>,
}

/// NVIDIA's `MPS` strategy with its `mpsConfig` (none = the daemon's defaults), checked under NVIDIA's field name.
fn mps_config(mps: Option<MpsConfig>) -> Result<GpuConfig, String> {
    let mps = mps.unwrap_or_default();
    mps.check("sharing.mpsConfig")?;
    Ok(GpuConfig { sharing: Sharing { strategy: SharingStrategy::Mps, time_slicing: None, mps: Some(mps) } })
}

impl NvidiaMigDocument {
    fn into_config(self) -> Result<GpuConfig, String> {
        let Some(sharing) = self.sharing else { return Ok(GpuConfig::default()) };
        match (sharing.strategy, sharing.mps_config) {
            (NvidiaStrategy::TimeSlicing, Some(_)) => {
                Err("sharing.mpsConfig: only allowed with sharing.strategy MPS".into())
            }
            (NvidiaStrategy::TimeSlicing, None) => Ok(GpuConfig::default()),
            (NvidiaStrategy::Mps, mps) => mps_config(mps),
        }
    }
}

/// One configuration entry of a claim's allocation, in the order the API lists them (class entries first).
#[derive(Debug)]
pub struct ConfigEntry<'a> {
    /// `FromClass` or `FromClaim`, for error messages.
    pub source: &'a str,
    /// Requests it applies to; empty = all.
    pub requests: &'a [String],
    pub driver: &'a str,
    pub parameters: &'a serde_json::Value,
}

/// The kind of device an NVIDIA-spelt document configures: its `GpuConfig` whole GPUs only, its `MigDeviceConfig` MIG
/// devices only (the driver's own `GpuConfig` configures both). `None`: not NVIDIA's spelling.
fn nvidia_kind(parameters: &serde_json::Value) -> Option<DeviceKind> {
    let meta = TypeMeta::deserialize(parameters).ok()?;
    match (meta.api_version.as_str(), meta.kind.as_str()) {
        (NVIDIA_CONFIG_API_VERSION, GPU_CONFIG_KIND) => Some(DeviceKind::Gpu),
        (NVIDIA_CONFIG_API_VERSION, NVIDIA_MIG_CONFIG_KIND) => Some(DeviceKind::Mig),
        _ => None,
    }
}

/// Whole GPU or MIG device: what an allocated device is, for the NVIDIA configuration kinds that apply to one only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Gpu,
    Mig,
}

/// The effective configuration of `request` (a base request name or `request/subrequest`) allocated a device of
/// `kind`: the last entry of this driver that applies wins, so a claim's entry overrides its class's. Entries of
/// other drivers are not ours to read. As NVIDIA's driver does, an NVIDIA-spelt entry naming no request applies only
/// to devices of its kind (a claim's `GpuConfig` and `MigDeviceConfig` each configure their own devices), and one
/// naming the request exactly with the other kind is an error if it wins. One naming the main request of a
/// subrequest applies to the alternatives of its kind only (a `GpuConfig` for `req` configures `req/h100`, not the
/// MIG fallback `req/mig`).
pub fn effective_config(
    driver: &str,
    request: &str,
    kind: DeviceKind,
    entries: &[ConfigEntry<'_>],
) -> Result<GpuConfig, String> {
    let base = request.split('/').next().unwrap_or(request);
    let mut effective = Ok(GpuConfig::default());
    for (position, entry) in entries.iter().enumerate() {
        // Named exactly (`req`, or `req/sub` for a subrequest), or through its main request (`req` for `req/sub`).
        let exact = entry.requests.iter().any(|r| r == request);
        let applies = exact || entry.requests.is_empty() || entry.requests.iter().any(|r| r == base);
        if entry.driver != driver || !applies {
            continue;
        }
        let at = || format!("config #{} ({})", position + 1, entry.source);
        match nvidia_kind(entry.parameters) {
            // Refused only if it would win: a later entry may still configure the request.
            Some(only) if only != kind && exact => {
                let (document, device, instead) = match only {
                    DeviceKind::Gpu => (GPU_CONFIG_KIND, "a MIG device", NVIDIA_MIG_CONFIG_KIND),
                    DeviceKind::Mig => (NVIDIA_MIG_CONFIG_KIND, "a whole GPU", GPU_CONFIG_KIND),
                };
                effective = Err(format!(
                    "{}: NVIDIA's {document} cannot configure request {request:?}, which was allocated {device}; use \
                     kind {instead} for it",
                    at()
                ));
                continue;
            }
            // For another kind of device (one alternative of a request with subrequests, say): not this one's.
            Some(only) if only != kind => continue,
            _ => {}
        }
        effective = Ok(GpuConfig::decode(driver, entry.parameters).map_err(|e| format!("{}: {e}", at()))?);
    }
    effective
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DRIVER: &str = "gpu.gpu-dra.dev";

    fn doc(extra: serde_json::Value) -> serde_json::Value {
        let mut value = json!({"apiVersion": "gpu.gpu-dra.dev/v1alpha1", "kind": "GpuConfig"});
        if let (Some(map), serde_json::Value::Object(extra)) = (value.as_object_mut(), extra) {
            map.extend(extra);
        }
        value
    }

    #[test]
    fn an_error_naming_a_tenants_field_escapes_its_control_characters() {
        let parameters = json!({"apiVersion": format!("{DRIVER}/v1alpha1"), "kind": "GpuConfig",
                                "x\nINFO forged line\u{1b}[31m": 1});
        let error = GpuConfig::decode(DRIVER, &parameters).expect_err("an unknown field");
        assert!(!error.chars().any(char::is_control), "{error:?}");
        assert!(error.contains("x\\nINFO forged line\\u{1b}[31m"), "{error}");
        let reordered = json!({"apiVersion": format!("{DRIVER}/v1alpha1"), "kind": "GpuConfig",
                               "a\u{202e}upg\u{2028}b\u{2066}": 1});
        let error = GpuConfig::decode(DRIVER, &reordered).expect_err("an unknown field");
        assert!(!error.chars().any(reshapes_text), "{error:?}");
        assert!(error.contains("a\\u{202e}upg\\u{2028}b\\u{2066}"), "{error}");
    }

    #[test]
    fn decodes_valid_documents() {
        assert_eq!(GpuConfig::decode(DRIVER, &doc(json!({}))), Ok(GpuConfig::default()));
        let config = GpuConfig::decode(
            DRIVER,
            &doc(json!({"sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}})),
        );
        assert_eq!(
            config.map(|c| c.sharing),
            Ok(Sharing {
                strategy: SharingStrategy::TimeSlicing,
                time_slicing: Some(TimeSlicing { interval: TimeSliceInterval::Long }),
                mps: None,
            })
        );
        let mps = GpuConfig::decode(
            DRIVER,
            &doc(json!({"sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 25,
                "defaultPinnedDeviceMemoryLimit": "10Gi", "defaultPerDevicePinnedMemoryLimit": {"1": "512Mi"}}}})),
        );
        let expected = MpsConfig {
            default_active_thread_percentage: Some(25),
            default_pinned_device_memory_limit: Some("10Gi".into()),
            default_per_device_pinned_memory_limit: BTreeMap::from([("1".into(), "512Mi".into())]),
        };
        assert_eq!(mps.map(|c| c.sharing.mps), Ok(Some(expected)));
        // A bare number of bytes, as Kubernetes quantities allow.
        let bytes = GpuConfig::decode(
            DRIVER,
            &doc(json!({"sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": 1073741824}}})),
        );
        let limit = bytes.map(|c| c.sharing.mps.and_then(|m| m.default_pinned_device_memory_limit));
        assert_eq!(limit, Ok(Some("1073741824".into())));
    }

    #[test]
    fn memory_quantities_in_bytes_and_pinned_limits_in_whole_mib() {
        let cases = [
            ("1Gi", Ok(1 << 30)),
            ("512Mi", Ok(512 << 20)),
            ("1.5Gi", Ok(3 << 29)),
            ("10M", Ok(10_000_000)),
            ("1G", Ok(1_000_000_000)),
            ("1048576", Ok(1 << 20)),
            ("0.5Ki", Ok(512)),
            // The exponent form the API server writes back for a quantity given as one, and the other valid forms.
            ("1e10", Ok(10_000_000_000)),
            ("5E9", Ok(5_000_000_000)),
            ("1.5e3", Ok(1500)),
            ("25e-1", Ok(3)),
            ("+1Gi", Ok(1 << 30)),
            ("1500m", Ok(2)),
            ("1500000u", Ok(2)),
            ("1n", Ok(1)),
            ("0.0001k", Ok(1)),
            ("1E", Ok(1_000_000_000_000_000_000)),
        ];
        for (quantity, want) in cases {
            assert_eq!(memory_bytes(quantity), want, "{quantity}");
        }
        for bad in [
            "",
            "Gi",
            "1GB",
            "-1Gi",
            "1..5Gi",
            "1e",
            "1e+",
            "e3",
            "1e99",
            "1e-2147483648",
            "1e3Gi",
            "99999999999Ei",
            "1.5.e3",
        ] {
            assert!(memory_bytes(bad).is_err(), "{bad:?} accepted");
        }
        // NVIDIA's driver rounds down to MiB the same way: 10M is 9 MiB, 1G is 953.
        let limits = [("1Gi", Ok(1024)), ("10Mi", Ok(10)), ("10M", Ok(9)), ("1G", Ok(953))];
        for (quantity, want) in limits {
            assert_eq!(pinned_limit_mib(quantity), want, "{quantity}");
        }
        assert!(pinned_limit_mib("1M").is_err_and(|e| e.contains("below 1Mi")));
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (doc(json!({"sharin": {}})), "unknown field `sharin`"),
            (doc(json!({"sharing": {"strategy": "Spatial"}})), "sharing.strategy: unknown variant `Spatial`"),
            (
                doc(json!({"sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short", "x": 1}}})),
                "sharing.timeSlicing.x: unknown field `x`",
            ),
            (doc(json!({"sharing": {"timeSlicing": {}}})), "sharing.timeSlicing: only allowed with"),
            (doc(json!({"sharing": {"strategy": "MPS", "timeSlicing": {}}})), "sharing.timeSlicing: only allowed with"),
            (doc(json!({"sharing": {"strategy": "TimeSlicing", "mps": {}}})), "sharing.mps: only allowed with"),
            (
                doc(json!({"sharing": {"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "10Gb"}}})),
                "sharing.mps.defaultPinnedDeviceMemoryLimit: \"10Gb\" is not a memory quantity",
            ),
            (
                doc(json!({"sharing": {"strategy": "MPS", "mps": {"defaultPerDevicePinnedMemoryLimit": {"": "1Gi"}}}})),
                "sharing.mps.defaultPerDevicePinnedMemoryLimit: an empty key",
            ),
            (json!({"apiVersion": "gpu.gpu-dra.dev/v9", "kind": "GpuConfig"}), "understands apiVersion"),
            (json!({"apiVersion": "gpu.gpu-dra.dev/v1alpha1", "kind": "Other"}), "kind \"Other\""),
            (json!(["not", "an", "object"]), "not an object"),
        ];
        for (input, expected) in cases {
            match GpuConfig::decode(DRIVER, &input) {
                Ok(config) => panic!("{input} decoded to {config:?}"),
                Err(error) => assert!(error.contains(expected), "{input}: {error:?} lacks {expected:?}"),
            }
        }
    }

    fn nvidia(sharing: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing})
    }

    #[test]
    fn nvidias_spelling_is_accepted() {
        let time_slicing = |interval| {
            Ok(GpuConfig {
                sharing: Sharing {
                    strategy: SharingStrategy::TimeSlicing,
                    time_slicing: Some(TimeSlicing { interval }),
                    mps: None,
                },
            })
        };
        let mps = |mps| {
            Ok(GpuConfig { sharing: Sharing { strategy: SharingStrategy::Mps, time_slicing: None, mps: Some(mps) } })
        };
        let cases = [
            (json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}), Ok(GpuConfig::default())),
            (nvidia(json!({"strategy": "TimeSlicing"})), time_slicing(TimeSliceInterval::Default)),
            (
                nvidia(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
                time_slicing(TimeSliceInterval::Long),
            ),
            (nvidia(json!({"strategy": "MPS"})), mps(MpsConfig::default())),
            (
                nvidia(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "1Gi", "defaultPerDevicePinnedMemoryLimit": {"GPU-a": "2Gi"}}})),
                mps(MpsConfig {
                    default_active_thread_percentage: Some(50),
                    default_pinned_device_memory_limit: Some("1Gi".into()),
                    default_per_device_pinned_memory_limit: BTreeMap::from([("GPU-a".into(), "2Gi".into())]),
                }),
            ),
            (
                json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
                       "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 10}}}),
                mps(MpsConfig { default_active_thread_percentage: Some(10), ..MpsConfig::default() }),
            ),
            (
                nvidia(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {}})),
                time_slicing(TimeSliceInterval::Default),
            ),
            // A MIG device has no time slice of its own: TimeSlicing leaves it as it is.
            (
                json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
                       "sharing": {"strategy": "TimeSlicing"}}),
                Ok(GpuConfig::default()),
            ),
            (json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"}), Ok(GpuConfig::default())),
        ];
        for (input, want) in cases {
            assert_eq!(GpuConfig::decode(DRIVER, &input), want, "{input}");
        }
    }

    #[test]
    fn nvidias_spelling_refuses_what_this_driver_cannot_do_by_name() {
        let mig = |sharing: serde_json::Value| json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig", "sharing": sharing});
        let cases = [
            (
                nvidia(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}})),
                "sharing.mpsConfig.defaultActiveThreadPercentage: 0 is not a percentage",
            ),
            (
                nvidia(json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1Ki"}})),
                "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: \"1Ki\" is below 1Mi",
            ),
            (
                nvidia(json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "lots"}}})),
                "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[\"0\"]: \"lots\" is not a memory quantity",
            ),
            (
                nvidia(json!({"strategy": "MPS", "mpsConfig": {"multiUser": true}})),
                "sharing.mpsConfig.multiUser: unknown field `multiUser`",
            ),
            (nvidia(json!({"strategy": "TimeSlicing", "mpsConfig": {}})), "sharing.mpsConfig: only allowed with"),
            (
                nvidia(json!({"strategy": "MPS", "timeSlicingConfig": {"interval": "Short"}})),
                "sharing.timeSlicingConfig: only allowed with",
            ),
            (nvidia(json!({"strategy": "Fabric"})), "sharing.strategy: unknown variant `Fabric`"),
            (nvidia(json!({"timeSlicingConfig": {}})), "sharing: missing field `strategy`"),
            (
                nvidia(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}})),
                "sharing.timeSlicingConfig.interval: unknown variant `Forever`",
            ),
            (nvidia(json!({"strategy": "TimeSlicing", "replicas": 4})), "sharing.replicas: unknown field `replicas`"),
            (
                mig(json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}})),
                "sharing.mpsConfig.defaultActiveThreadPercentage: 101",
            ),
            (
                mig(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
                "sharing.timeSlicingConfig: unknown field `timeSlicingConfig`",
            ),
            (mig(json!({"strategy": "TimeSlicing", "mpsConfig": {}})), "sharing.mpsConfig: only allowed with"),
            (json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain"}), "NVIDIA's"),
        ];
        for (input, expected) in cases {
            match GpuConfig::decode(DRIVER, &input) {
                Ok(config) => panic!("{input} decoded to {config:?}"),
                Err(error) => assert!(error.contains(expected), "{input}: {error:?} lacks {expected:?}"),
            }
        }
    }

    #[test]
    fn claim_config_overrides_class_config_for_the_requests_it_names() {
        let class = doc(json!({"sharing": {"strategy": "TimeSlicing"}}));
        let claim = doc(json!({"sharing": {"strategy": "Exclusive"}}));
        let other_driver = json!({"anything": true});
        let names = ["big".to_string()];
        let entries = [
            ConfigEntry { source: "FromClass", requests: &[], driver: DRIVER, parameters: &class },
            ConfigEntry { source: "FromClaim", requests: &names, driver: DRIVER, parameters: &claim },
            ConfigEntry { source: "FromClaim", requests: &[], driver: "other.example.com", parameters: &other_driver },
        ];
        let strategy =
            |request| effective_config(DRIVER, request, DeviceKind::Gpu, &entries).map(|c| c.sharing.strategy);
        assert_eq!(strategy("big"), Ok(SharingStrategy::Exclusive));
        assert_eq!(strategy("big/h100"), Ok(SharingStrategy::Exclusive));
        assert_eq!(strategy("small"), Ok(SharingStrategy::TimeSlicing));
    }

    #[test]
    fn a_bad_entry_is_named_by_position_and_source() {
        let bad = doc(json!({"sharing": {"strategy": 7}}));
        let entries = [ConfigEntry { source: "FromClaim", requests: &[], driver: DRIVER, parameters: &bad }];
        let error = effective_config(DRIVER, "gpu", DeviceKind::Gpu, &entries).err().unwrap_or_default();
        assert!(error.starts_with("config #1 (FromClaim): sharing.strategy:"), "{error}");
    }

    /// NVIDIA's `GpuConfig` and `MigDeviceConfig` naming no request each configure their own kind of device (as in
    /// NVIDIA's driver: a claim of a GPU and a MIG device with one of each); naming a request of the other kind is an
    /// error. The driver's own `GpuConfig` configures both.
    #[test]
    fn nvidia_kinds_configure_their_own_devices() {
        let nvidia = |kind: &str, sharing: serde_json::Value| json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "sharing": sharing});
        let gpu = nvidia("GpuConfig", json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}));
        let mig = nvidia("MigDeviceConfig", json!({"strategy": "MPS"}));
        let own = doc(json!({"sharing": {"strategy": "TimeSlicing"}}));
        let entry = |parameters, requests| ConfigEntry { source: "FromClaim", requests, driver: DRIVER, parameters };
        let strategy = |entries: &[ConfigEntry<'_>], request, kind| {
            effective_config(DRIVER, request, kind, entries).map(|c| c.sharing.strategy)
        };
        let both = [entry(&gpu, &[]), entry(&mig, &[])];
        assert_eq!(strategy(&both, "gpu", DeviceKind::Gpu), Ok(SharingStrategy::TimeSlicing));
        assert_eq!(strategy(&both, "mig", DeviceKind::Mig), Ok(SharingStrategy::Mps));
        let only_gpu = [entry(&gpu, &[])];
        assert_eq!(strategy(&only_gpu, "mig", DeviceKind::Mig), Ok(SharingStrategy::Exclusive));
        let own_last = [entry(&gpu, &[]), entry(&own, &[])];
        assert_eq!(strategy(&own_last, "mig", DeviceKind::Mig), Ok(SharingStrategy::TimeSlicing));
        let names = ["mig".to_string()];
        let named = [entry(&gpu, &names)];
        let error = strategy(&named, "mig", DeviceKind::Mig).err().unwrap_or_default();
        assert!(
            error.starts_with("config #1 (FromClaim): NVIDIA's GpuConfig cannot configure request \"mig\"")
                && error.contains("use kind MigDeviceConfig"),
            "{error}"
        );
        // Overridden by a later entry for the request: not an error.
        let overridden = [entry(&gpu, &names), entry(&mig, &names)];
        assert_eq!(strategy(&overridden, "mig", DeviceKind::Mig), Ok(SharingStrategy::Mps));
        // Named through the main request of a subrequest: the alternatives of its kind only.
        let main = ["gpu".to_string()];
        let through_main = [entry(&gpu, &main)];
        assert_eq!(strategy(&through_main, "gpu/h100", DeviceKind::Gpu), Ok(SharingStrategy::TimeSlicing));
        assert_eq!(strategy(&through_main, "gpu/mig", DeviceKind::Mig), Ok(SharingStrategy::Exclusive));
    }
}
