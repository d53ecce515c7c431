//! Group commit: kubelet calls that arrive together share the checkpoint's saves.
//!
//! The kubelet prepares each pod's claims in a call of its own and starts pods in parallel (a worker per pod). A
//! call may be answered only once its change is on disk — a prepare is two fsync'd checkpoint saves around its CDI
//! specs — and calls done one at a time queue behind each other's fsyncs, which on a disk where an fsync takes tens
//! of milliseconds adds up to seconds for a node starting dozens of GPU pods. So a call joins a [`Queue`] instead,
//! and whichever waiting call takes the state lock first does the work of every call queued by then in one pass
//! (one save before the specs, one after; two of each when some of its claims need slow GPU work and some do not)
//! and answers each of them; a call whose work another took only waits for its answer. The price: a failed save
//! fails every claim of its part of the batch (the kubelet retries them). A call is answered as soon as all its
//! claims are settled ([`Replies::answer_settled`]): a claim prepared before, or one needing nothing slow of the
//! GPUs, is not held back by another call's MIG make or MPS daemon start in the same batch (see
//! `DriverState::prepare_planned`).
//!
//! Pure bookkeeping, no I/O: the batch (each claim once, in the order asked, so two pods sharing a claim that start
//! together prepare it once) and the answers split back per call.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::oneshot;

use super::allocation::ClaimRef;
use super::state::ClaimResult;

/// What a batch is made of: anything naming the claim it is about.
pub trait ForClaim {
    fn uid(&self) -> &str;

    /// Whether this item can be worked on; of two items for one claim, a usable one is kept over one that is not
    /// (a prepare whose claim read failed, beside another call's successful read of the same claim).
    fn usable(&self) -> bool {
        true
    }
}

impl ForClaim for ClaimRef {
    fn uid(&self) -> &str {
        &self.uid
    }
}

/// Calls waiting for the state lock, with what each asks.
#[derive(Debug)]
pub struct Queue<T, A> {
    waiting: Mutex<Vec<Waiter<T, A>>>,
    /// Calls in the queue, for `/metrics`: a slow disk shows here first.
    gauge: Gauge,
}

/// Where one call's answers go: one per claim it asked for, in its order.
type Reply<A> = oneshot::Sender<Vec<ClaimResult<A>>>;

#[derive(Debug)]
struct Waiter<T, A> {
    items: Vec<T>,
    reply: Reply<A>,
}

impl<T: ForClaim, A: Clone> Queue<T, A> {
    pub fn new(gauge: Gauge) -> Self {
        Self { waiting: Mutex::new(Vec::new()), gauge }
    }

    /// Queues one call's items; its answers (one per item, in its order) arrive on the receiver from whichever call
    /// commits them. The receiver errs if that commit panicked.
    pub fn join(&self, items: Vec<T>) -> oneshot::Receiver<Vec<ClaimResult<A>>> {
        let (reply, answer) = oneshot::channel();
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.push(Waiter { items, reply });
        // Under the queue's lock, so a take() in between cannot see the call without its count.
        self.gauge.inc();
        answer
    }

    /// Takes every queued call: the batch to do and who to answer. `None` when another commit took them all. Call it
    /// holding the state lock, so everything queued while the lock was busy goes in this one batch.
    pub fn take(&self) -> Option<(Vec<T>, Replies<A>)> {
        let waiters = std::mem::take(&mut *self.waiting.lock().unwrap_or_else(PoisonError::into_inner));
        if waiters.is_empty() {
            return None;
        }
        self.gauge.dec_by(waiters.len() as i64);
        let mut batch: Vec<T> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut calls = Vec::with_capacity(waiters.len());
        for Waiter { items, reply } in waiters {
            let uids = items.iter().map(|item| item.uid().to_owned()).collect();
            for item in items {
                match index.get(item.uid()) {
                    None => {
                        index.insert(item.uid().to_owned(), batch.len());
                        batch.push(item);
                    }
                    Some(&at) if !batch[at].usable() && item.usable() => batch[at] = item,
                    Some(_) => {}
                }
            }
            calls.push((uids, reply));
        }
        Some((batch, Replies { calls }))
    }
}

/// The calls a batch answers, each with the claims it asked for.
#[derive(Debug)]
pub struct Replies<A> {
    calls: Vec<(Vec<String>, Reply<A>)>,
}

impl<A: Clone> Replies<A> {
    /// Answers now each call whose claims all have a result in `results` (the batch's so far), so that it does not
    /// wait for the rest of the batch; the others stay for [`Self::answer`].
    pub fn answer_settled(&mut self, results: &[ClaimResult<A>]) {
        let done: HashMap<&str, &Result<A, String>> = results.iter().map(|(uid, r)| (uid.as_str(), r)).collect();
        let (settled, waiting) = std::mem::take(&mut self.calls)
            .into_iter()
            .partition(|(uids, _): &(Vec<String>, _)| uids.iter().all(|uid| done.contains_key(uid.as_str())));
        self.calls = waiting;
        for (uids, reply) in settled {
            let answers = uids
                .into_iter()
                .filter_map(|uid| {
                    let result = (*done.get(uid.as_str())?).clone();
                    Some((uid, result))
                })
                .collect();
            let _ = reply.send(answers);
        }
    }

    /// Answers every call from the batch's results; a claim the batch left unanswered is an error to retry.
    pub fn answer(self, results: Vec<ClaimResult<A>>) {
        let results: HashMap<String, Result<A, String>> = results.into_iter().collect();
        for (uids, reply) in self.calls {
            let answers = uids
                .into_iter()
                .map(|uid| {
                    let result =
                        results.get(&uid).cloned().unwrap_or_else(|| Err(format!("claim {uid}: no answer; retry")));
                    (uid, result)
                })
                .collect();
            // A caller that is gone (the kubelet's deadline passed) has nobody left to tell.
            let _ = reply.send(answers);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef { namespace: "ns".into(), name: format!("claim-{uid}"), uid: uid.into() }
    }

    fn uids<T: ForClaim>(batch: &[T]) -> Vec<&str> {
        batch.iter().map(ForClaim::uid).collect()
    }

    #[test]
    fn a_batch_holds_every_waiting_call_and_each_claim_once() {
        let queue: Queue<ClaimRef, u32> = Queue::new(Gauge::default());
        let mut first = queue.join(vec![claim("a"), claim("b")]);
        let mut second = queue.join(vec![claim("b"), claim("c"), claim("c")]);
        assert_eq!(queue.gauge.get(), 2);
        let Some((batch, replies)) = queue.take() else { panic!("nothing taken") };
        assert_eq!(uids(&batch), ["a", "b", "c"]);
        assert_eq!(queue.gauge.get(), 0);
        assert!(queue.take().is_none(), "a second commit finds nothing left");
        replies.answer(vec![("a".into(), Ok(1)), ("b".into(), Err("busy".into())), ("c".into(), Ok(3))]);
        let first = first.try_recv().expect("first answered");
        assert_eq!(first, vec![("a".into(), Ok(1)), ("b".into(), Err("busy".into()))]);
        let second = second.try_recv().expect("second answered");
        assert_eq!(second, vec![("b".into(), Err("busy".into())), ("c".into(), Ok(3)), ("c".into(), Ok(3))]);
    }

    /// A claim read that may have failed, as a prepare's plan.
    #[derive(Debug)]
    struct Read(ClaimRef, bool);

    impl ForClaim for Read {
        fn uid(&self) -> &str {
            &self.0.uid
        }
        fn usable(&self) -> bool {
            self.1
        }
    }

    #[test]
    fn of_two_items_for_one_claim_the_usable_one_is_kept() {
        let queue: Queue<Read, u32> = Queue::new(Gauge::default());
        let _failed_first = queue.join(vec![Read(claim("a"), false), Read(claim("b"), true)]);
        let _then_ok = queue.join(vec![Read(claim("a"), true), Read(claim("b"), false)]);
        let Some((batch, _)) = queue.take() else { panic!("nothing taken") };
        let kept: Vec<(&str, bool)> = batch.iter().map(|r| (r.uid(), r.1)).collect();
        assert_eq!(kept, [("a", true), ("b", true)]);
    }

    #[test]
    fn a_claim_the_batch_left_unanswered_is_an_error() {
        let queue: Queue<ClaimRef, u32> = Queue::new(Gauge::default());
        let mut call = queue.join(vec![claim("a"), claim("b")]);
        let Some((_, replies)) = queue.take() else { panic!("nothing taken") };
        replies.answer(vec![("a".into(), Ok(1))]);
        let answers = call.try_recv().expect("answered");
        assert_eq!(answers[0], ("a".into(), Ok(1)));
        assert!(matches!(&answers[1], (uid, Err(e)) if uid == "b" && e.contains("no answer")), "{answers:?}");
    }

    #[test]
    fn a_call_whose_claims_are_all_settled_is_answered_before_the_batch_ends() {
        let queue: Queue<ClaimRef, u32> = Queue::new(Gauge::default());
        let mut quick = queue.join(vec![claim("a")]);
        let mut mixed = queue.join(vec![claim("a"), claim("slow")]);
        let Some((_, mut replies)) = queue.take() else { panic!("nothing taken") };
        replies.answer_settled(&[("a".into(), Ok(1))]);
        assert_eq!(quick.try_recv().expect("answered at once"), vec![("a".into(), Ok(1))]);
        assert!(mixed.try_recv().is_err(), "a call with a claim still in work was answered");
        replies.answer_settled(&[("a".into(), Ok(1))]);
        replies.answer(vec![("a".into(), Ok(1)), ("slow".into(), Ok(2))]);
        assert_eq!(mixed.try_recv().expect("answered at the end"), vec![("a".into(), Ok(1)), ("slow".into(), Ok(2))]);
    }

    #[test]
    fn a_commit_that_dies_leaves_its_callers_an_error_not_a_hang() {
        let queue: Queue<ClaimRef, u32> = Queue::new(Gauge::default());
        let mut call = queue.join(vec![claim("a")]);
        drop(queue.take());
        assert!(call.try_recv().is_err());
    }

    #[test]
    fn a_caller_that_left_does_not_stop_the_others_answers() {
        let queue: Queue<ClaimRef, u32> = Queue::new(Gauge::default());
        drop(queue.join(vec![claim("a")]));
        let mut stays = queue.join(vec![claim("a")]);
        let Some((batch, replies)) = queue.take() else { panic!("nothing taken") };
        assert_eq!(uids(&batch), ["a"]);
        replies.answer(vec![("a".into(), Ok(7))]);
        assert_eq!(stays.try_recv().expect("answered"), vec![("a".into(), Ok(7))]);
    }
}
