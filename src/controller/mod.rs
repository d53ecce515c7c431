//! The ResourceClaimTemplate controller: creates each pod's ResourceClaims from its templates, the way
//! kube-controller-manager's resourceclaim controller does.
//!
//! Not built yet; `run` refuses to start so that nothing mistakes it for a working controller.

use crate::cli::ControllerArgs;

/// Errors of the controller component.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("the controller is not implemented yet")]
    NotImplemented,
}

/// Runs the controller until it is told to stop.
pub async fn run(_args: ControllerArgs) -> Result<(), ControllerError> {
    Err(ControllerError::NotImplemented)
}
