//! The command line: one subcommand per component, shared flag groups flattened in.
//!
//! Every flag has an environment-variable twin so that a Helm chart can set it either way.

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Kubernetes Dynamic Resource Allocation for NVIDIA GPUs.
#[derive(Debug, Parser)]
#[command(name = "gpu-dra", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create each pod's ResourceClaims from its ResourceClaimTemplates (kube-controller-manager style).
    Controller(ControllerArgs),
    /// Discover this node's GPUs, publish them as ResourceSlices and serve the kubelet DRA plugin API.
    NodeAgent(NodeAgentArgs),
}

/// Logging flags shared by every component.
#[derive(Debug, Args)]
pub struct LogArgs {
    /// Log filter in `tracing` syntax, e.g. `info` or `gpu_dra=debug,kube=info`.
    #[arg(long, env = "GPU_DRA_LOG", default_value = "info", global = true)]
    pub log_filter: String,
    /// Log line format: `text` for people, `json` for log pipelines.
    #[arg(long, env = "GPU_DRA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Flags of `gpu-dra controller`.
#[derive(Debug, Args)]
pub struct ControllerArgs {}

/// Flags of `gpu-dra node-agent`.
#[derive(Debug, Args)]
pub struct NodeAgentArgs {}
