//! The NVML calls for MIG that `nvml-wrapper` 0.13 lacks or gets wrong, made directly through `nvml-wrapper-sys`:
//! one of the crate's three places of `unsafe`. Each call passes handles that belong to a `Device` borrowing the
//! initialised `Nvml`, and buffers NVML writes at most their given length into. (The MPS daemon's system calls,
//! `node_agent::mps_sys`, and the open-file limit, `open_files`, are the others.)

#![allow(unsafe_code)]

use std::path::Path;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
    NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE, NVML_GPU_INSTANCE_PROFILE_COUNT,
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlGpuInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t,
};

use tracing::warn;

use super::DiscoveryError;
use crate::node_agent::gpu::{Gpu, MigDevice};
use crate::node_agent::mig;

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: nvml-wrapper 0.13's `possible_placements` never sets the length
/// of the vector NVML fills, so it always answers none.
pub(super) fn placements(nvml: &Nvml, device: &Device<'_>, profile_id: u32) -> Result<Vec<(u32, u32)>, NvmlError> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstancePossiblePlacements_v2.as_ref())?;
    // SAFETY: see the module documentation; NVML reports in `count` how many placements it wrote.
    unsafe {
        let handle = device.handle();
        let mut count: std::os::raw::c_uint = 0;
        nvml_try(sym(handle, profile_id, std::ptr::null_mut(), &mut count))?;
        let mut buffer = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        nvml_try(sym(handle, profile_id, buffer.as_mut_ptr(), &mut count))?;
        buffer.truncate(count as usize);
        Ok(buffer.into_iter().map(|p| (p.start, p.size)).collect())
    }
}

/// Labels an NVML error with the step that failed (`what`), as the make and destroy calls report them.
fn step(what: &'static str) -> impl FnOnce(NvmlError) -> (&'static str, NvmlError) {
    move |error| (what, error)
}

/// The step label of a missing NVML function (a driver older than the call).
const FIND_FUNCTION: &str = "find the NVML function";

/// Makes a GPU instance of `profile` at memory slice `start` and one compute instance spanning it
/// (`nvmlDeviceCreateGpuInstanceWithPlacement`, then `nvmlGpuInstanceCreateComputeInstance` with the compute profile
/// of as many slices, engines shared); answers the two instance IDs. When the compute instance cannot be made, the
/// GPU instance is destroyed again, so nothing half-made is left. The error says which step failed.
pub(super) fn create_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    profile: &mig::Profile,
    start: u32,
) -> Result<(u32, u32), (&'static str, NvmlError)> {
    let info = device.profile_info(profile.nvml_id).map_err(step("read the GPU instance profile"))?;
    let create_gi =
        nvml_sym(nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement.as_ref()).map_err(step(FIND_FUNCTION))?;
    let placement = nvmlGpuInstancePlacement_t { start, size: profile.memory_slices };
    // SAFETY: see the module documentation; the placement outlives the call, NVML writes one handle.
    let gpu_instance = unsafe {
        let mut instance: nvmlGpuInstance_t = std::mem::zeroed();
        nvml_try(create_gi(device.handle(), info.id, &placement, &mut instance))
            .map_err(step("create the GPU instance"))?;
        instance
    };
    match compute_instance_in(nvml, gpu_instance, profile.compute_slices) {
        Ok(ids) => Ok(ids),
        Err(error) => {
            if let Err(undo) = destroy_gpu_instance(nvml, gpu_instance) {
                warn!(%undo, "could not destroy the GPU instance whose compute instance failed; destroy it by hand");
            }
            Err(error)
        }
    }
}

/// Makes the compute instance spanning `gpu_instance` (of `slices` compute slices) and answers both IDs.
fn compute_instance_in(
    nvml: &Nvml,
    gpu_instance: nvmlGpuInstance_t,
    slices: u32,
) -> Result<(u32, u32), (&'static str, NvmlError)> {
    let profile = match slices {
        1 => NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        2 => NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
        3 => NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        4 => NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
        6 => NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
        7 => NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
        8 => NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
        _ => return Err(("choose the compute instance profile", NvmlError::InvalidArg)),
    };
    let lib = nvml.lib();
    let profile_info =
        nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref()).map_err(step(FIND_FUNCTION))?;
    let create_ci = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref()).map_err(step(FIND_FUNCTION))?;
    let gi_info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref()).map_err(step(FIND_FUNCTION))?;
    let ci_info = nvml_sym(lib.nvmlComputeInstanceGetInfo_v2.as_ref()).map_err(step(FIND_FUNCTION))?;
    // SAFETY: see the module documentation; every structure is plain C data NVML fills in.
    unsafe {
        let mut info: nvmlComputeInstanceProfileInfo_t = std::mem::zeroed();
        nvml_try(profile_info(gpu_instance, profile, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut info))
            .map_err(step("read the compute instance profile"))?;
        let mut compute: nvmlComputeInstance_t = std::mem::zeroed();
        nvml_try(create_ci(gpu_instance, info.id, &mut compute)).map_err(step("create the compute instance"))?;
        let mut gi: nvmlGpuInstanceInfo_t = std::mem::zeroed();
        nvml_try(gi_info(gpu_instance, &mut gi)).map_err(step("read the GPU instance"))?;
        let mut ci: nvmlComputeInstanceInfo_t = std::mem::zeroed();
        nvml_try(ci_info(compute, &mut ci)).map_err(step("read the compute instance"))?;
        Ok((gi.id, ci.id))
    }
}

/// Destroys compute instance `compute_instance` of GPU instance `gpu_instance` on `device`, then the GPU instance.
pub(super) fn destroy_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    gpu_instance: u32,
    compute_instance: u32,
) -> Result<(), (&'static str, NvmlError)> {
    let lib = nvml.lib();
    let ci_by_id = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceById.as_ref()).map_err(step(FIND_FUNCTION))?;
    let destroy_ci = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref()).map_err(step(FIND_FUNCTION))?;
    let gi = gpu_instance_by_id(nvml, device, gpu_instance).map_err(step("find the GPU instance"))?;
    // SAFETY: see the module documentation; the handles come from NVML for this device.
    unsafe {
        let mut ci: nvmlComputeInstance_t = std::mem::zeroed();
        nvml_try(ci_by_id(gi, compute_instance, &mut ci)).map_err(step("find the compute instance"))?;
        nvml_try(destroy_ci(ci)).map_err(step("destroy the compute instance"))?;
    }
    destroy_gpu_instance(nvml, gi).map_err(step("destroy the GPU instance"))
}

fn destroy_gpu_instance(nvml: &Nvml, gpu_instance: nvmlGpuInstance_t) -> Result<(), NvmlError> {
    let destroy = nvml_sym(nvml.lib().nvmlGpuInstanceDestroy.as_ref())?;
    // SAFETY: see the module documentation; the handle is NVML's.
    unsafe { nvml_try(destroy(gpu_instance)) }
}

/// The MIG devices that exist on `gpu` (MIG mode on): each one's UUID, GPU and compute instance, the GPU instance's
/// profile and placement, its memory and multiprocessors, and the `nvidia-caps` minors a container needs. A MIG
/// device whose compute instance uses only part of its GPU instance (several compute instances per GPU instance:
/// NVIDIA's `1c.3g.40gb` kind) is left out with a warning, as is one NVML cannot describe (e.g. torn down while it is
/// read): the node's other devices are still published.
pub(super) fn mig_devices(nvml: &Nvml, device: &Device<'_>, gpu: &Gpu) -> Result<Vec<MigDevice>, DiscoveryError> {
    let max = device
        .mig_device_count()
        .map_err(|source| DiscoveryError::Nvml { what: format!("the MIG device count of GPU {}", gpu.uuid), source })?;
    let profiles = mig::profiles(gpu).unwrap_or_default();
    let caps_major = std::fs::read_to_string("/proc/devices")
        .ok()
        .and_then(|devices| mig::char_device_major(&devices, "nvidia-caps"));
    let mut found = Vec::new();
    for index in 0..max {
        let mig = match device.mig_device_by_index(index) {
            Ok(mig) => mig,
            // Indexes without a MIG device answer "not found".
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(error) => {
                warn!(gpu = %gpu.uuid, index, %error, "cannot read a MIG device; it is not published");
                continue;
            }
        };
        match mig_device(nvml, device, &mig, gpu, &profiles, caps_major) {
            Ok(Some(found_device)) => found.push(found_device),
            Ok(None) => {}
            Err((what, error)) => {
                warn!(gpu = %gpu.uuid, index, what, %error, "cannot read a MIG device; it is not published");
            }
        }
    }
    found.sort_by_key(|m| (m.placement_start, m.compute_instance));
    Ok(found)
}

/// One MIG device, `None` when it is a compute instance using part of its GPU instance; the error says what could
/// not be read.
fn mig_device(
    nvml: &Nvml,
    parent: &Device<'_>,
    mig: &Device<'_>,
    gpu: &Gpu,
    profiles: &[mig::Profile],
    caps_major: Option<u32>,
) -> Result<Option<MigDevice>, (&'static str, NvmlError)> {
    let uuid = mig.uuid().map_err(step("its UUID"))?;
    let attributes = mig.attributes().map_err(step("its attributes"))?;
    let (gpu_instance, compute_instance) = instance_ids(nvml, mig).map_err(step("its instance IDs"))?;
    if attributes.compute_instance_slice_count < attributes.gpu_instance_slice_count {
        warn!(
            gpu = %gpu.uuid, mig = %uuid, gpu_instance, compute_instance,
            "a compute instance using {} of its GPU instance's {} slices is not published: only MIG devices whose \
             compute instance spans the whole GPU instance are (nvidia-smi mig -cgi <profile> -C)",
            attributes.compute_instance_slice_count, attributes.gpu_instance_slice_count
        );
        return Ok(None);
    }
    let info = gpu_instance_info(nvml, parent, gpu_instance).map_err(step("its GPU instance"))?;
    // Matched by NVML's profile ID (what a GPU instance reports), not by the profile index. A profile the table does
    // not know (a model it does not list: GH200, H100 NVL, H20, A30, …) gets NVML's own name, which says `+me` and
    // the memory as NVIDIA rounds it; the name built from the instance's size is the last resort.
    let profile = match profiles.iter().find(|p| p.id == info.profileId) {
        Some(known) => known.name.to_string(),
        None => nvml_profile_name(nvml, parent, info.profileId).unwrap_or_else(|| {
            format!("{}g.{}gb", attributes.gpu_instance_slice_count, attributes.memory_size_mb.div_ceil(1024))
        }),
    };
    let (gi_cap_minor, ci_cap_minor) = cap_minors(gpu.minor, gpu_instance, compute_instance);
    Ok(Some(MigDevice {
        uuid,
        profile,
        profile_id: info.profileId,
        gpu_instance,
        compute_instance,
        placement_start: info.placement.start,
        placement_size: info.placement.size,
        memory_bytes: attributes.memory_size_mb << 20,
        multiprocessors: attributes.multiprocessor_count,
        gi_cap_minor,
        ci_cap_minor,
        caps_major,
    }))
}

/// `nvmlGpuInstanceProfileInfo_v2`: the structure's size and version, as `NVML_STRUCT_VERSION` makes it.
const PROFILE_INFO_V2: u32 = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32 | (2 << 24);

/// NVML's name of GPU instance profile `profile_id` on `device` (see [`profile_name`]), found by asking each profile
/// index (what NVML's profile information is asked by; a GPU instance reports the ID). `None` where the driver
/// names no profile of that ID, or cannot be asked: said once in the log, since the name then falls back to the
/// instance's size (`1g.12gb` for a `1g.12gb+me`), which selectors of NVIDIA's names miss.
fn nvml_profile_name(nvml: &Nvml, device: &Device<'_>, profile_id: u32) -> Option<String> {
    // Once each: discovery asks again every round.
    static UNASKED: std::sync::Once = std::sync::Once::new();
    static MISSHAPEN: std::sync::Once = std::sync::Once::new();
    let unasked = |error: NvmlError| {
        UNASKED.call_once(|| {
            warn!(
                profile_id, %error,
                "NVML's MIG profile names could not be read; profiles the table lacks are named from their size"
            )
        })
    };
    let sym = match nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()) {
        Ok(sym) => sym,
        Err(error) => {
            unasked(error);
            return None;
        }
    };
    for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        // SAFETY: see the module documentation; the structure is plain C data NVML fills in, its version set.
        let asked = unsafe {
            let mut info: nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
            info.version = PROFILE_INFO_V2;
            nvml_try(sym(device.handle(), index, &mut info)).map(|()| info)
        };
        let info = match asked {
            Ok(info) => info,
            // A profile index this GPU does not have.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::NotFound) => continue,
            Err(error) => {
                unasked(error);
                return None;
            }
        };
        if info.id == profile_id {
            return profile_name(&info.name)
                .map_err(|raw| {
                    MISSHAPEN.call_once(|| {
                        warn!(
                            profile_id,
                            raw, "NVML's name of a MIG profile is not shaped like one; named from its size"
                        )
                    })
                })
                .ok();
        }
    }
    None
}

/// A MIG profile's name from NVML's (`MIG 1g.12gb+me` → `1g.12gb+me`): up to its NUL, without the `MIG ` prefix,
/// and only when shaped as NVIDIA's names are (`<compute>g.<memory>gb`, then suffixes such as `+me`, `-me`,
/// `+gfx`, `+me.all`), at most 64 bytes (a device attribute's limit). Otherwise the text as read, for the warning.
fn profile_name(raw: &[std::os::raw::c_char]) -> Result<String, String> {
    let bytes: Vec<u8> = raw.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
    let text = String::from_utf8_lossy(&bytes);
    let name = text.trim();
    let name = name.strip_prefix("MIG ").unwrap_or(name).trim();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let shaped = name.split_once("g.").and_then(|(compute, rest)| {
        let memory_end = rest.find("gb")?;
        let suffix = &rest[memory_end + 2..];
        let suffix_ok = suffix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
        (digits(compute) && digits(&rest[..memory_end]) && suffix_ok).then_some(())
    });
    match shaped {
        Some(()) if name.len() <= 64 => Ok(name.to_string()),
        _ => Err(text.into_owned()),
    }
}

fn instance_ids(nvml: &Nvml, mig: &Device<'_>) -> Result<(u32, u32), NvmlError> {
    let gi_sym = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
    let ci_sym = nvml_sym(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref())?;
    let (mut gi, mut ci): (std::os::raw::c_uint, std::os::raw::c_uint) = (0, 0);
    // SAFETY: see the module documentation.
    unsafe {
        nvml_try(gi_sym(mig.handle(), &mut gi))?;
        nvml_try(ci_sym(mig.handle(), &mut ci))?;
    }
    Ok((gi, ci))
}

fn gpu_instance_info(nvml: &Nvml, device: &Device<'_>, id: u32) -> Result<nvmlGpuInstanceInfo_t, NvmlError> {
    let instance = gpu_instance_by_id(nvml, device, id)?;
    let get_info = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    // SAFETY: see the module documentation; the structure is plain C data NVML fills in.
    unsafe {
        let mut info: nvmlGpuInstanceInfo_t = std::mem::zeroed();
        nvml_try(get_info(instance, &mut info))?;
        Ok(info)
    }
}

/// The handle of GPU instance `id` on `device`.
fn gpu_instance_by_id(nvml: &Nvml, device: &Device<'_>, id: u32) -> Result<nvmlGpuInstance_t, NvmlError> {
    let by_id = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    // SAFETY: see the module documentation; NVML writes one handle.
    unsafe {
        let mut instance: nvmlGpuInstance_t = std::mem::zeroed();
        nvml_try(by_id(device.handle(), id, &mut instance))?;
        Ok(instance)
    }
}

/// The `nvidia-caps` minors of a GPU instance and its compute instance, from the driver's
/// `/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<I>[/ci<C>]/access` (`DeviceFileMinor: N`); where the driver
/// does not expose them, its fixed numbering ([`mig::cap_minors`]).
fn cap_minors(gpu_minor: u32, gi: u32, ci: u32) -> (u32, u32) {
    let base = Path::new("/proc/driver/nvidia/capabilities").join(format!("gpu{gpu_minor}/mig/gi{gi}"));
    let table = mig::cap_minors(gpu_minor, gi, ci);
    let read = |path: &Path| std::fs::read_to_string(path).ok().and_then(|text| mig::parse_cap_minor(&text));
    let gi_minor = read(&base.join("access")).unwrap_or(table.0);
    let ci_minor = read(&base.join(format!("ci{ci}/access"))).unwrap_or(table.1);
    (gi_minor, ci_minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> [std::os::raw::c_char; 96] {
        let mut buffer = [0; 96];
        for (to, from) in buffer.iter_mut().zip(text.bytes()) {
            *to = from as std::os::raw::c_char;
        }
        buffer
    }

    /// NVML's names as `nvidia-smi mig -lgip` shows them, of models the profile table does not list.
    #[test]
    fn profile_names_from_nvml() {
        let cases = [
            ("MIG 1g.12gb", Some("1g.12gb")),
            ("MIG 1g.12gb+me", Some("1g.12gb+me")),
            ("MIG 1g.24gb+gfx", Some("1g.24gb+gfx")),
            ("MIG 1g.23gb-me", Some("1g.23gb-me")),
            ("MIG 2g.48gb+me.all", Some("2g.48gb+me.all")),
            ("7g.94gb", Some("7g.94gb")),
            ("", None),
            ("MIG", None),
            ("MIG 1g.", None),
            ("MIG xg.10gb", None),
            ("MIG 1g.10gb extra", None),
            ("MIG 1g.10GB", None),
        ];
        for (text, want) in cases {
            assert_eq!(profile_name(&raw(text)).ok().as_deref(), want, "{text:?}");
        }
        // Not NUL-terminated within the buffer: refused by the 64-byte limit of an attribute.
        let mut full = [b'1' as std::os::raw::c_char; 96];
        assert_eq!(profile_name(&full).ok(), None);
        full[..7].copy_from_slice(&raw("1g.10gb")[..7]);
        assert_eq!(profile_name(&full).ok(), None, "a name running to the end of the buffer");
        assert_eq!(profile_name(&raw("MIG 1g.10GB")), Err("MIG 1g.10GB".to_string()), "the text, for the warning");
    }
}
