//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics.
//!
//! - A candidate takes the Lease when it is free or its holder has not renewed it for `lease_duration`, measured
//!   on the candidate's own clock from the moment it last saw the record change (clock skew between machines does
//!   not matter).
//! - Every write carries the Lease's resourceVersion, so two candidates can never both win: the loser gets a
//!   conflict.
//! - A leader that cannot renew within `renew_deadline` stops leading and [`LeaderElector::run`] returns an error:
//!   the component exits instead of writing without the Lease (its replacement takes over). The deadline counts
//!   from the start of the last successful renewal and bounds every attempt, so a request that hangs (an API
//!   server that stops answering) cannot keep a replica leading past it: with `renew_deadline < lease_duration`
//!   the leader has stopped before any other candidate can see the Lease expire. Like client-go's `renew`, whose
//!   attempts share one context that times out at the renew deadline; we count from the start of the last
//!   renewal rather than one retry period after it, which only ever stops earlier.
//! - A candidate's attempt is bounded by `renew_deadline` too (kube-controller-manager gives its election client
//!   that timeout), so a hung request never delays the next try by however long it hangs.
//! - On shutdown a leader releases the Lease, so a successor takes over at once instead of after a lease duration.
//!
//! ```text
//!   Unknown ──first attempt──▶ Leader ◀──acquire── Follower
//!                                 │ no renewal within renew_deadline (failed, refused or unanswered)
//!                                 ▼
//!                           run() returns Err(LostLease)
//! ```

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;
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
    #[error(
        "leader election timing: {0}; choose --leader-elect-lease-duration > --leader-elect-renew-deadline > \
         1.2 × --leader-elect-retry-period > 0 (defaults 15s, 10s, 2s)"
    )]
    Timing(&'static str),
}

/// Why one attempt did not end with an answer.
#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("no answer from the API server before the attempt's deadline ({0:?} after it started)")]
    TimedOut(Duration),
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

impl Timing {
    /// client-go's rules: a leader must have given up before its Lease can expire for others
    /// (`renew_deadline < lease_duration`: the safety of the whole scheme), and have time for more than one
    /// attempt before it gives up.
    pub fn validate(&self) -> Result<(), LeaderError> {
        if self.retry_period.is_zero() {
            return Err(LeaderError::Timing("the retry period must be positive"));
        }
        // The Lease keeps it in whole seconds: 900ms was written as 0, and every standby took the lease at once.
        if self.lease_duration < Duration::from_secs(1) || self.lease_duration.subsec_nanos() != 0 {
            return Err(LeaderError::Timing("the lease duration must be whole seconds (the Lease keeps it so)"));
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(LeaderError::Timing("the lease duration must be longer than the renew deadline"));
        }
        if self.renew_deadline <= self.retry_period.mul_f64(1.2) {
            return Err(LeaderError::Timing("the renew deadline must be longer than 1.2 retry periods"));
        }
        Ok(())
    }
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
        // While leading: the start of the last successful renewal. The renew deadline counts from there.
        let mut renewed_at: Option<Instant> = None;
        loop {
            let leading = *role.borrow() == Role::Leader;
            let started = Instant::now();
            let deadline = match renewed_at {
                Some(renewed) if leading => renewed + self.timing.renew_deadline,
                _ => started + self.timing.renew_deadline,
            };
            let outcome = tokio::time::timeout_at(deadline, self.try_acquire_or_renew())
                .await
                .unwrap_or_else(|_| Err(AttemptError::TimedOut(started.elapsed())));
            match outcome {
                Ok(true) => {
                    renewed_at = Some(started);
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
                    if leading && Instant::now() >= deadline {
                        role.send_replace(Role::Follower);
                        return Err(self.lost());
                    }
                    if *role.borrow() == Role::Unknown {
                        role.send_replace(Role::Follower);
                    }
                }
            }
            // A leader never sleeps past its deadline: its last attempt starts there and gives up at once.
            let mut next = Instant::now() + self.timing.retry_period;
            if *role.borrow() == Role::Leader
                && let Some(renewed) = renewed_at
            {
                next = next.min(renewed + self.timing.renew_deadline);
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(next) => {}
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
    async fn try_acquire_or_renew(&mut self) -> Result<bool, AttemptError> {
        let now = MicroTime(Timestamp::now());
        let Some(mut lease) = self.api.get_opt(&self.lease).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.lease.clone()), ..Default::default() },
                spec: Some(self.spec_for_us(now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(err) => Err(err.into()),
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
            Err(err) => Err(err.into()),
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

    /// Gives the Lease up so that a successor need not wait for it to expire; bounded like an attempt, so a hung
    /// API server cannot hold up shutdown.
    async fn release(&self) {
        let release = async {
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
            self.api.replace(&self.lease, &PostParams::default(), &lease).await.map(drop).map_err(AttemptError::from)
        };
        let result = tokio::time::timeout(self.timing.renew_deadline, release)
            .await
            .unwrap_or(Err(AttemptError::TimedOut(self.timing.renew_deadline)));
        match result {
            Ok(()) => info!(lease = %self.lease, "released the lease"),
            Err(err) => {
                warn!(lease = %self.lease, error = %err, "could not release the lease; it expires by itself")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_is_validated_like_client_go() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        for (lease_duration, renew_deadline, retry_period, valid) in [
            (s(15), s(10), s(2), true),
            (s(4), s(3), ms(500), true),
            (s(10), s(10), s(2), false),
            (s(5), s(10), s(2), false),
            (s(15), ms(2400), s(2), false),
            (s(15), s(10), s(0), false),
            // The Lease keeps whole seconds: 900ms was written as 0 (client-go cuts it the same way).
            (ms(900), ms(800), ms(500), false),
            (ms(1500), s(1), ms(500), false),
        ] {
            let timing = Timing { lease_duration, renew_deadline, retry_period };
            assert_eq!(timing.validate().is_ok(), valid, "{timing:?}");
        }
        assert!(Timing::default().validate().is_ok());
    }
}
