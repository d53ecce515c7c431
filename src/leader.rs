//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics.
//!
//! - A candidate takes the Lease when it is free or its holder has not renewed it for `lease_duration`, measured
//!   on the candidate's own clock from the moment it last saw the record change (clock skew between machines does
//!   not matter).
//! - Every write carries the Lease's resourceVersion, so two candidates can never both win: the loser gets a
//!   conflict.
//! - A leader that cannot renew within `renew_deadline` stops leading and [`LeaderElector::run`] returns an error:
//!   the component exits instead of writing without the Lease (its replacement takes over).
//! - On shutdown a leader releases the Lease, so a successor takes over at once instead of after a lease duration.
//!
//! ```text
//!   Unknown ──first attempt──▶ Leader ◀──acquire── Follower
//!                                 │ renew fails past renew_deadline
//!                                 ▼
//!                           run() returns Err(LostLease)
//! ```

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// This replica's current role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// No attempt has finished yet.
    Unknown,
    Leader,
    Follower,
}

/// Errors that end leader election.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error(
        "lost the lease {lease}: could not renew it within {deadline:?}; stopping so that no write happens without it"
    )]
    LostLease { lease: String, deadline: Duration },
}

/// Timing of the election, as client-go's defaults unless configured.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// How long a Lease stays valid without renewal; a follower takes over after this.
    pub lease_duration: Duration,
    /// How long a leader keeps trying to renew before it gives up leading.
    pub renew_deadline: Duration,
    /// Pause between attempts.
    pub retry_period: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Contends for one Lease.
#[derive(Debug)]
pub struct LeaderElector {
    api: Api<Lease>,
    lease: String,
    identity: String,
    timing: Timing,
    /// The holder/renewTime last seen and when (our clock) it was first seen.
    observed: Option<(Option<String>, Option<MicroTime>, Instant)>,
}

impl LeaderElector {
    pub fn new(api: Api<Lease>, lease: impl Into<String>, identity: impl Into<String>, timing: Timing) -> Self {
        Self { api, lease: lease.into(), identity: identity.into(), timing, observed: None }
    }

    /// Contends until `stop` is cancelled, publishing the role to `role`. Returns an error when leadership is lost.
    pub async fn run(mut self, role: watch::Sender<Role>, stop: CancellationToken) -> Result<(), LeaderError> {
        let mut last_renewed: Option<Instant> = None;
        loop {
            let leading = *role.borrow() == Role::Leader;
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    last_renewed = Some(Instant::now());
                    if !leading {
                        info!(lease = %self.lease, identity = %self.identity, "became leader");
                    }
                    role.send_replace(Role::Leader);
                }
                Ok(false) if leading => {
                    // Someone else holds it now (a conflict on renewal): stop at once.
                    role.send_replace(Role::Follower);
                    return Err(self.lost());
                }
                Ok(false) => {
                    role.send_replace(Role::Follower);
                }
                Err(err) => {
                    warn!(lease = %self.lease, error = %err, "lease attempt failed");
                    if leading && last_renewed.is_some_and(|t| t.elapsed() > self.timing.renew_deadline) {
                        role.send_replace(Role::Follower);
                        return Err(self.lost());
                    }
                    if *role.borrow() == Role::Unknown {
                        role.send_replace(Role::Follower);
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(self.timing.retry_period) => {}
            }
        }
        if *role.borrow() == Role::Leader {
            self.release().await;
            role.send_replace(Role::Follower);
        }
        Ok(())
    }

    fn lost(&self) -> LeaderError {
        LeaderError::LostLease { lease: self.lease.clone(), deadline: self.timing.renew_deadline }
    }

    /// One attempt: `Ok(true)` when this replica holds the Lease afterwards.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let now = MicroTime(Timestamp::now());
        let Some(mut lease) = self.api.get_opt(&self.lease).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.lease.clone()), ..Default::default() },
                spec: Some(self.spec_for_us(now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(err) => Err(err),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (holder.clone(), spec.renew_time.clone());
        let changed = self.observed.as_ref().is_none_or(|(h, r, _)| (h, r) != (&record.0, &record.1));
        if changed {
            self.observed = Some((record.0, record.1, Instant::now()));
        }
        let held_by_us = holder.as_deref() == Some(self.identity.as_str());
        let duration = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)))
            .unwrap_or(self.timing.lease_duration);
        let expired = self.observed.as_ref().is_some_and(|(_, _, seen)| seen.elapsed() > duration);
        if !held_by_us && holder.is_some() && !expired {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0);
        let mut new_spec = self.spec_for_us(now.clone(), if held_by_us { transitions } else { transitions + 1 });
        if held_by_us {
            new_spec.acquire_time = spec.acquire_time;
        }
        lease.spec = Some(new_spec);
        // `lease` carries the resourceVersion we read: a concurrent writer makes this fail with a conflict.
        match self.api.replace(&self.lease, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(err) => Err(err),
        }
    }

    fn spec_for_us(&self, now: MicroTime, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: i32::try_from(self.timing.lease_duration.as_secs()).ok(),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// Gives the Lease up so that a successor need not wait for it to expire.
    async fn release(&self) {
        let result = async {
            let mut lease = self.api.get(&self.lease).await?;
            let Some(spec) = lease.spec.as_mut() else {
                return Ok(());
            };
            if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(Timestamp::now()));
            self.api.replace(&self.lease, &PostParams::default(), &lease).await.map(drop)
        }
        .await;
        match result {
            Ok(()) => info!(lease = %self.lease, "released the lease"),
            Err(err) => {
                warn!(lease = %self.lease, error = %err, "could not release the lease; it expires by itself")
            }
        }
    }
}
