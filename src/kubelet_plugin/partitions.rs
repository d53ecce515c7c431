//! Dynamic MIG on the node: the MIG device of each allocated partition made when its claim is prepared, and
//! destroyed when the claim is unprepared or its prepare is abandoned (see [`crate::node_agent::device::Partition`]).
//!
//! The checkpoint records the UUID of every MIG device made for a claim, before the claim's spec is written; only a
//! recorded UUID is ever destroyed, or the MIG device at a placement the checkpoint says a prepare was making a MIG
//! device on, having found it empty (`makingMig`: the prepare was killed between the make and the save of its
//! UUID). A MIG device an administrator made, one a claim only looks at (admin access), or one made for a claim
//! whose record was lost (a recovered entry) is never touched. Calls go through the discovery
//! backend (NVML, or the simulated GPUs) and may block: callers hold the state lock off the async threads.

use crate::node_agent::device::{Device, MigLayout, Partition, devices};
use crate::node_agent::discovery::Discovery;
use crate::node_agent::gpu::{Gpu, MigDevice};

/// How a claim gets the MIG device of a partition it was allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Making {
    /// Made now.
    Make,
    /// The claim's own earlier prepare (interrupted, or its spec lost) made the MIG device of this UUID: it is used
    /// if it is still at the placement, else one is made.
    Adopt(String),
    /// Admin access: looked at, never made. Where no MIG device exists at the placement, the claim gets the parent
    /// GPU's device node: what a monitoring agent reads the GPU and its MIG devices through.
    Look,
}

/// The MIG device at `partition`'s placement of `gpu` (the GPU as discovery reports it now), if one exists.
fn at_placement<'a>(gpu: &'a Gpu, partition: &Partition) -> Option<&'a MigDevice> {
    gpu.mig_devices.iter().find(|m| {
        m.placement_start == partition.start
            && m.profile_id == partition.profile.id
            && m.placement_size == partition.profile.memory_slices
    })
}

/// The MIG device at the placement of the dynamic MIG partition named `name` on `gpus` (as discovered now), if one
/// exists there; `None` also for a name that is no partition of theirs.
pub fn at_partition(gpus: &[Gpu], name: &str) -> Option<MigDevice> {
    let device = devices(gpus, MigLayout::Dynamic).into_iter().find(|d| d.partition.is_some() && d.name() == name)?;
    let gpu = gpus.iter().find(|g| g.uuid == device.gpu.uuid)?;
    at_placement(gpu, &device.partition?).cloned()
}

pub fn discover(control: &dyn Discovery) -> Result<Vec<Gpu>, String> {
    control.discover().map_err(|e| format!("discover the GPUs to find their MIG devices: {e}"))
}

/// Gets the MIG device of `device` when it is a partition as `making` says, and fills in `device.mig` with it.
/// Answers whether it was made now (to be destroyed again if the prepare fails later). A device that is not a
/// partition is left as it is.
pub fn make(control: &dyn Discovery, device: &mut Device, making: &Making) -> Result<bool, String> {
    let Some(partition) = device.partition else { return Ok(false) };
    let name = device.name();
    if *making != Making::Make {
        let gpus = discover(control)?;
        let gpu = gpus
            .iter()
            .find(|g| g.uuid == device.gpu.uuid)
            .ok_or_else(|| format!("GPU {} ({name}) is gone from this node", device.gpu.uuid))?;
        let existing = at_placement(gpu, &partition);
        match (making, existing) {
            (Making::Look, Some(existing)) => {
                device.mig = Some(existing.clone());
                return Ok(false);
            }
            (Making::Adopt(uuid), Some(existing)) if existing.uuid == *uuid => {
                device.mig = Some(existing.clone());
                return Ok(false);
            }
            (Making::Look, None) => {
                device.mig = None;
                return Ok(false);
            }
            _ => {}
        }
    }
    let made = control.create_mig_device(device.gpu.index, &partition.profile, partition.start).map_err(|e| {
        format!("make MIG device {name} ({} at memory slice {}): {e}", partition.profile.name, partition.start)
    })?;
    device.mig = Some(made);
    Ok(true)
}

/// Destroys the MIG device of UUID `uuid`, wherever it is; `false` when there is none (destroyed already).
pub fn destroy(control: &dyn Discovery, uuid: &str) -> Result<bool, String> {
    let gpus = discover(control)?;
    let found = gpus.iter().find_map(|g| g.mig_devices.iter().find(|m| m.uuid == uuid).map(|m| (g, m)));
    let Some((gpu, mig)) = found else { return Ok(false) };
    control
        .destroy_mig_device(gpu.index, mig.gpu_instance, mig.compute_instance)
        .map_err(|e| format!("destroy MIG device {uuid} ({} on GPU {}): {e}", mig.profile, gpu.uuid))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_agent::discovery::simulated::Simulated;

    #[test]
    fn a_partition_is_made_on_prepare_and_destroyed_by_its_uuid() {
        let simulated = Simulated::new("node", "1xH100-80GB/mig=1g.10gb").expect("spec");
        let gpus = simulated.discover().expect("discover");
        let admins = gpus[0].mig_devices[0].uuid.clone();
        let all = devices(&gpus, MigLayout::Dynamic);
        let named = |name: &str| all.iter().find(|d| d.name() == name).cloned().expect(name);
        let mut three = named("gpu-0-mig-9-4-4");
        assert_eq!(make(&simulated, &mut three, &Making::Make), Ok(true), "room for a 3g.40gb at slice 4");
        let made = three.mig.clone().expect("made");
        assert_eq!((made.profile.as_str(), made.placement_start), ("3g.40gb", 4));
        let mut again = named("gpu-0-mig-9-4-4");
        let overlap = make(&simulated, &mut again, &Making::Make).expect_err("taken");
        assert!(overlap.contains("make MIG device gpu-0-mig-9-4-4") && overlap.contains("overlaps"), "{overlap}");
        let mut look = named("gpu-0-mig-9-4-4");
        assert_eq!(make(&simulated, &mut look, &Making::Look), Ok(false), "admin access looks at the made device");
        assert_eq!(look.mig.as_ref().map(|m| &m.uuid), Some(&made.uuid));
        let mut adopted = named("gpu-0-mig-9-4-4");
        assert_eq!(make(&simulated, &mut adopted, &Making::Adopt(made.uuid.clone())), Ok(false), "its own device");
        assert_eq!(adopted.mig.as_ref().map(|m| &m.uuid), Some(&made.uuid));
        let mut not_its_own = named("gpu-0-mig-19-0-1");
        let taken = make(&simulated, &mut not_its_own, &Making::Adopt("MIG-gone".into())).expect_err("another's");
        assert!(taken.contains("overlaps MIG device"), "another device at the placement is never adopted: {taken}");
        let mut absent = named("gpu-0-mig-14-2-2");
        assert_eq!(make(&simulated, &mut absent, &Making::Look), Ok(false), "admin access makes nothing");
        assert!(absent.mig.is_none(), "nothing there: the parent GPU is what admin access gets");
        assert_eq!(destroy(&simulated, &made.uuid), Ok(true));
        assert_eq!(destroy(&simulated, &made.uuid), Ok(false), "gone already: nothing to do");
        let mut fresh = named("gpu-0-mig-9-4-4");
        assert_eq!(make(&simulated, &mut fresh, &Making::Adopt(made.uuid.clone())), Ok(true), "gone: made again");
        let left: Vec<String> =
            simulated.discover().expect("discover")[0].mig_devices.iter().map(|m| m.uuid.clone()).collect();
        assert!(left.contains(&admins) && left.len() == 2, "the administrator's 1g.10gb is never touched: {left:?}");
        let mut whole = named("gpu-0");
        let busy = make(&simulated, &mut whole, &Making::Make).expect_err("the 1g.10gb is in the way");
        assert!(busy.contains("7g.80gb"), "{busy}");
    }
}
