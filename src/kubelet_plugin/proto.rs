//! Code generated at build time from `proto/` (see build.rs): the kubelet's plugin registration API and the two
//! versions of the DRA plugin service, and the two versions of the DRA resource health service.
#![allow(missing_docs, unreachable_pub, missing_debug_implementations, clippy::all)]

/// `pluginregistration` (the kubelet's plugin watcher).
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

/// `k8s.io.kubelet.pkg.apis.dra.v1`, registered as `v1.DRAPlugin`.
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// `k8s.io.kubelet.pkg.apis.dra.v1beta1`, registered as `v1beta1.DRAPlugin`.
pub mod dra_v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}

/// `v1` of `k8s.io/kubelet/pkg/apis/dra-health`, registered as `v1.DRAResourceHealth` (the module is named after the
/// proto package, which the generated `v1alpha1` code refers to).
pub mod v1 {
    tonic::include_proto!("v1");
}

/// `v1alpha1` of `k8s.io/kubelet/pkg/apis/dra-health`, registered as `v1alpha1.DRAResourceHealth` (v1's messages).
pub mod v1alpha1 {
    tonic::include_proto!("v1alpha1");
}
