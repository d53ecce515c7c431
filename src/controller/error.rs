//! Errors of one sync. Each variant names the action that failed and the object it failed on.

use super::queue::ObjectKey;

/// Why a sync failed. Every variant is retried with back-off; the Kubernetes error inside says whether a retry
/// can help (a conflict will, a forbidden verb needs an operator).
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("resource claim template \"{template}\" in namespace {namespace}: not found")]
    TemplateNotFound { namespace: String, template: String },
    #[error("resource claim template \"{template}\": {source}")]
    Template {
        template: String,
        #[source]
        source: super::decide::TemplateError,
    },
    #[error("pod claim \"{pod_claim}\" sets neither resourceClaimName nor resourceClaimTemplateName (unsupported API)")]
    UnsupportedPodClaim { pod_claim: String },
    #[error("create ResourceClaim for pod claim \"{pod_claim}\" from template \"{template}\": {source}")]
    CreateClaim {
        pod_claim: String,
        template: String,
        #[source]
        source: kube::Error,
    },
    #[error("apply the resourceClaimStatuses of pod {pod}: {source}")]
    ApplyPodStatus {
        pod: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("reserve claim {claim} for pod {pod}: {source}")]
    ReserveClaim {
        claim: ObjectKey,
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("update the status of claim {claim}: {source}")]
    UpdateClaimStatus {
        claim: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("remove the finalizer of claim {claim}: {source}")]
    RemoveFinalizer {
        claim: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("delete claim {claim}: {source}")]
    DeleteClaim {
        claim: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("get claim {claim}: {source}")]
    GetClaim {
        claim: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("get pod {pod}: {source}")]
    GetPod {
        pod: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("apply the resourceClaimStatuses of PodGroup {group}: {source}")]
    ApplyPodGroupStatus {
        group: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("get PodGroup {group}: {source}")]
    GetPodGroup {
        group: ObjectKey,
        #[source]
        source: kube::Error,
    },
    #[error("the pod belongs to PodGroup {group}, which does not exist (yet): create the PodGroup")]
    PodGroupNotFound { group: ObjectKey },
    #[error(
        "the pod belongs to PodGroup {group}, but PodGroups are not handled yet (the API server does not serve \
         scheduling.k8s.io/v1beta1 podgroups, or the controller may not list them; see its log): the pod gets no \
         claim of its own"
    )]
    PodGroupsNotHandled { group: ObjectKey },
    #[error("decode the ResourceClaim the API server returned: {0}")]
    DecodeClaim(#[source] serde_json::Error),
    #[error("sync did not finish within {0:?}")]
    Timeout(std::time::Duration),
}

impl SyncError {
    /// A short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            SyncError::TemplateNotFound { .. } => "template_not_found",
            SyncError::Template { .. } => "template_invalid",
            SyncError::UnsupportedPodClaim { .. } => "unsupported_pod_claim",
            SyncError::CreateClaim { .. } => "create_claim",
            SyncError::ApplyPodStatus { .. } => "apply_pod_status",
            SyncError::ReserveClaim { .. } => "reserve_claim",
            SyncError::UpdateClaimStatus { .. } => "update_claim_status",
            SyncError::RemoveFinalizer { .. } => "remove_finalizer",
            SyncError::DeleteClaim { .. } => "delete_claim",
            SyncError::GetPod { .. } => "get_pod",
            SyncError::GetClaim { .. } => "get_claim",
            SyncError::ApplyPodGroupStatus { .. } => "apply_podgroup_status",
            SyncError::GetPodGroup { .. } => "get_podgroup",
            SyncError::PodGroupNotFound { .. } => "podgroup_not_found",
            SyncError::PodGroupsNotHandled { .. } => "podgroups_not_handled",
            SyncError::DecodeClaim(_) => "decode_claim",
            SyncError::Timeout(_) => "timeout",
        }
    }

    /// The API server's refusal, when the error is one: the status code and its message (which, for 403, names
    /// the user, verb and resource).
    pub fn api_status(&self) -> Option<(u16, &str)> {
        let source = match self {
            SyncError::CreateClaim { source, .. }
            | SyncError::ApplyPodStatus { source, .. }
            | SyncError::ReserveClaim { source, .. }
            | SyncError::UpdateClaimStatus { source, .. }
            | SyncError::RemoveFinalizer { source, .. }
            | SyncError::DeleteClaim { source, .. }
            | SyncError::GetPod { source, .. }
            | SyncError::GetClaim { source, .. }
            | SyncError::ApplyPodGroupStatus { source, .. }
            | SyncError::GetPodGroup { source, .. } => source,
            _ => return None,
        };
        match source {
            kube::Error::Api(status) => Some((status.code, status.message.as_str())),
            _ => None,
        }
    }
}
