//! What a real node changes on the machine, read from the kernel and the tools that change it: the state
//! `e2e/node.sh down` must restore.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use anyhow::{Context as _, bail};

/// Where e2e/node.sh keeps a node's runtime directories (its default GPU_DRA_NODE_ROOT).
const NODE_ROOT: &str = "/var/lib/gpu-dra-e2e-node";
/// The kernel settings the kubelet and the CNI bridge change.
const SYSCTLS: &[&str] = &[
    "net/ipv4/ip_forward",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Snapshot {
    sysctls: BTreeMap<String, String>,
    /// `iptables-save` and `ip6tables-save` without comments and counters.
    rules: BTreeSet<String>,
    links: BTreeSet<String>,
    netns: BTreeSet<String>,
    /// Mounts whose target is a node's, a pod's or a runtime's.
    mounts: BTreeSet<String>,
    /// `kubepods` cgroups, in any hierarchy.
    pub(crate) cgroups: BTreeSet<String>,
    /// Command lines of processes that name the node root.
    pub(crate) processes: BTreeSet<String>,
    node_root_exists: bool,
}

pub(crate) fn snapshot() -> anyhow::Result<Snapshot> {
    let mut sysctls = BTreeMap::new();
    for s in SYSCTLS {
        if let Ok(v) = std::fs::read_to_string(format!("/proc/sys/{s}")) {
            sysctls.insert((*s).to_string(), v.trim().to_string());
        }
    }
    let mut rules = BTreeSet::new();
    for tool in ["iptables-save", "ip6tables-save"] {
        let output = Command::new(tool).output().with_context(|| format!("run {tool}"))?;
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if line.starts_with('#') {
                continue;
            }
            // Chain lines carry packet counters: keep the name and policy.
            let line = match line.strip_prefix(':') {
                Some(chain) => format!(":{}", chain.split(" [").next().unwrap_or(chain)),
                None => line.to_string(),
            };
            rules.insert(format!("{tool}: {line}"));
        }
    }
    let links = command_lines("ip", &["-o", "link", "show"])?
        .into_iter()
        .filter_map(|l| l.split(':').nth(1).map(|n| n.trim().split('@').next().unwrap_or("").to_string()))
        .collect();
    let mut netns = BTreeSet::new();
    for dir in ["/run/netns", "/var/run/netns"] {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                netns.insert(format!("{dir}/{}", entry.file_name().to_string_lossy()));
            }
        }
    }
    let mounts = std::fs::read_to_string("/proc/mounts")?
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| ["gpu-dra-e2e-node", "netns", "kubelet", "containerd"].iter().any(|k| m.contains(k)))
        .map(String::from)
        .collect();
    let mut cgroups = BTreeSet::new();
    for entry in std::fs::read_dir("/sys/fs/cgroup")?.flatten() {
        let kubepods = entry.path().join("kubepods");
        if kubepods.exists() {
            cgroups.insert(kubepods.display().to_string());
        }
    }
    let processes = processes_naming(NODE_ROOT)?.into_values().collect();
    Ok(Snapshot {
        sysctls,
        rules,
        links,
        netns,
        mounts,
        cgroups,
        processes,
        node_root_exists: std::path::Path::new(NODE_ROOT).exists(),
    })
}

impl Snapshot {
    /// What differs from `after`, one line per difference ("+" appeared, "-" disappeared, "~" changed).
    pub(crate) fn diff(&self, after: &Snapshot) -> Vec<String> {
        let mut out = Vec::new();
        for (k, v) in &self.sysctls {
            if after.sysctls.get(k) != Some(v) {
                out.push(format!("~ sysctl {k}: {v} -> {:?}", after.sysctls.get(k)));
            }
        }
        let sets = [
            ("rule", &self.rules, &after.rules),
            ("link", &self.links, &after.links),
            ("netns", &self.netns, &after.netns),
            ("mount", &self.mounts, &after.mounts),
            ("cgroup", &self.cgroups, &after.cgroups),
            ("process", &self.processes, &after.processes),
        ];
        for (what, before, after) in sets {
            out.extend(after.difference(before).map(|x| format!("+ {what} {x}")));
            out.extend(before.difference(after).map(|x| format!("- {what} {x}")));
        }
        if self.node_root_exists != after.node_root_exists {
            out.push(format!("~ {NODE_ROOT} exists: {} -> {}", self.node_root_exists, after.node_root_exists));
        }
        out
    }
}

fn command_lines(program: &str, args: &[&str]) -> anyhow::Result<Vec<String>> {
    let output = Command::new(program).args(args).output().with_context(|| format!("run {program}"))?;
    Ok(String::from_utf8_lossy(&output.stdout).lines().map(String::from).collect())
}

/// pid → command line (arguments joined by spaces) of every process whose command line contains `needle`.
pub(crate) fn processes_naming(needle: &str) -> anyhow::Result<BTreeMap<u32, String>> {
    let mut found = BTreeMap::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ").trim().to_string();
        if cmdline.contains(needle) && pid != std::process::id() {
            found.insert(pid, cmdline);
        }
    }
    Ok(found)
}

/// SIGKILLs every process whose command line contains one of `needles`: their command lines.
pub(crate) fn kill_every_process_naming(needles: &[&str]) -> anyhow::Result<Vec<String>> {
    let mut found = BTreeMap::new();
    for needle in needles {
        found.extend(processes_naming(needle)?);
    }
    for pid in found.keys() {
        let status = Command::new("kill").args(["-KILL", &pid.to_string()]).status()?;
        // A short-lived process may have ended between the listing and the kill.
        if !status.success() && std::path::Path::new(&format!("/proc/{pid}")).exists() {
            bail!("kill -KILL {pid} failed");
        }
    }
    Ok(found.into_values().collect())
}

/// SIGKILLs the one process whose command line contains `needle` (e.g. a node's kubelet).
pub(crate) fn kill_process_naming(needle: &str) -> anyhow::Result<()> {
    let found = processes_naming(needle)?;
    let [(pid, _)] = found.iter().collect::<Vec<_>>()[..] else {
        bail!("expected one process naming {needle:?}, found {found:?}");
    };
    let status = Command::new("kill").args(["-KILL", &pid.to_string()]).status()?;
    if !status.success() {
        bail!("kill -KILL {pid} failed");
    }
    Ok(())
}
