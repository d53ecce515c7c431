//! The GPU node agent: discovers GPUs, publishes ResourceSlices and serves the kubelet's DRA plugin API.
//!
//! Not built yet; `run` refuses to start so that nothing mistakes it for a working agent.

use crate::cli::NodeAgentArgs;

/// Errors of the node agent component.
#[derive(Debug, thiserror::Error)]
pub enum NodeAgentError {
    #[error("the node agent is not implemented yet")]
    NotImplemented,
}

/// Runs the node agent until it is told to stop.
pub async fn run(_args: NodeAgentArgs) -> Result<(), NodeAgentError> {
    Err(NodeAgentError::NotImplemented)
}
