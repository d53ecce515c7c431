//! gpu-dra: Kubernetes Dynamic Resource Allocation (structured parameters) for NVIDIA GPUs.
//!
//! Two components share this crate and its binary:
//! - [`controller`]: creates each pod's ResourceClaims from ResourceClaimTemplates (kube-controller-manager parity).
//! - [`node_agent`]: discovers GPUs, publishes ResourceSlices and serves the kubelet's DRA plugin API.
//!
//! See ARCHITECTURE.md for the map.

pub mod cdi;
pub mod cli;
pub mod controller;
pub mod event_note;
pub mod fsutil;
pub mod kube_client;
pub mod kubelet_plugin;
pub mod leader;
pub mod node_agent;
pub mod open_files;
pub mod proc_stat;
pub mod signals;
pub mod telemetry;
