//! A batch of receipts: the same steps as one receipt ([`super::send`]), with the database's
//! part done once for the batch ([`super::claims`]) and the mails sent side by side over the
//! mailer's pooled connections. Every guarantee of the single path holds per receipt: a receipt is
//! claimed (committed) before its mail leaves, recorded in the transaction that releases its
//! claim, and checked at the relay when an earlier attempt may have sent it.

use std::collections::HashSet;

use contract::ReceiptJob;
use schema::models::RECORDED_VIA_SMTP;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{
    Disposition, HandleError, ReceiptWorker, claim::Claim, claims, send::EarlierMail, send::Owed,
    send::owed_from,
};
use crate::{consumer::Delivered, consumer::JobHandler, mailer::Receipt, redact};

/// Where a receipt of the batch stands after the batch's statements.
enum Step {
    Decided(Disposition),
    /// Another attempt holds the claim: this one takes the single path, which waits for it.
    Contended,
    Claimed(Claim, Receipt),
}

/// A receipt after its mail was handed to the relay, or what became of it instead.
enum Mailed {
    Decided(Disposition),
    Sent {
        claim: Claim,
        to: String,
        verified: bool,
    },
}

impl ReceiptWorker {
    /// One outcome per job, in order. The rides must be distinct (the handler's `run_batch`
    /// holds back a ride's second delivery), or the claim statement would meet one twice.
    pub(super) async fn send_batch(
        &self,
        jobs: Vec<Delivered<ReceiptJob>>,
        shutdown: &CancellationToken,
    ) -> Vec<Disposition> {
        let steps = match self.claim_batch(&jobs).await {
            Ok(steps) => steps,
            Err(error) => {
                let reason = error.to_string();
                return jobs
                    .iter()
                    .map(|_| Disposition::Retry(reason.clone()))
                    .collect();
            }
        };
        let mailing = jobs
            .into_iter()
            .zip(steps)
            .map(|(delivered, step)| async move {
                match step {
                    Step::Decided(disposition) => Mailed::Decided(disposition),
                    Step::Contended => Mailed::Decided(self.run(delivered, shutdown).await),
                    Step::Claimed(claim, receipt) => {
                        self.mail_claimed(claim, receipt)
                            .instrument(delivered.span)
                            .await
                    }
                }
            });
        let mailed = futures_util::future::join_all(mailing).await;
        self.record_batch(mailed).await
    }

    /// The batch's rides, claims and duplicates, in three statements on one connection.
    async fn claim_batch(&self, jobs: &[Delivered<ReceiptJob>]) -> Result<Vec<Step>, HandleError> {
        let mut conn = self.pool.get().await?;
        let ride_ids: Vec<i64> = jobs.iter().map(|delivered| delivered.job.ride_id).collect();
        let rides = claims::rides_of(&mut conn, &ride_ids).await?;
        let mut steps = Vec::with_capacity(jobs.len());
        let mut wanted = Vec::new();
        let mut receipts = std::collections::HashMap::new();
        for delivered in jobs {
            let ride_id = delivered.job.ride_id;
            match owed_from(&delivered.job, rides.get(&ride_id).cloned()) {
                Owed::Nothing(reason) => steps.push(Step::Decided(Disposition::DeadLetter(reason))),
                Owed::Receipt(receipt) => {
                    steps.push(Step::Contended);
                    wanted.push((ride_id, delivered.message_id.as_str()));
                    receipts.insert(ride_id, receipt);
                }
            }
        }
        if wanted.is_empty() {
            return Ok(steps);
        }
        let taken = claims::take_all(&mut conn, &wanted, self.config.claim_lease).await?;
        let sent: HashSet<i64> = claims::drop_sent(&mut conn, &taken.iter().collect::<Vec<_>>())
            .await?
            .into_iter()
            .collect();
        for claim in taken {
            let Some(at) = jobs.iter().position(|d| d.job.ride_id == claim.ride_id) else {
                continue;
            };
            steps[at] = if sent.contains(&claim.ride_id) {
                tracing::info!(parent: &jobs[at].span, ride_id = claim.ride_id, "receipt already sent");
                Step::Decided(Disposition::Duplicate)
            } else {
                match receipts.remove(&claim.ride_id) {
                    Some(receipt) => Step::Claimed(claim, receipt),
                    None => Step::Contended,
                }
            };
        }
        Ok(steps)
    }

    /// A claimed receipt: an earlier attempt's mail looked for if there may be one, then the mail.
    async fn mail_claimed(&self, claim: Claim, receipt: Receipt) -> Mailed {
        let verified = match self.earlier_mail(&claim).await {
            Ok(EarlierMail::FoundAtRelay) => return Mailed::Decided(Disposition::Recovered),
            Ok(EarlierMail::NotSent) => true,
            Ok(EarlierMail::Unknown) => false,
            Err(error) => return Mailed::Decided(error.disposition()),
        };
        match self.mail(&claim, &receipt).await {
            Ok(()) => Mailed::Sent {
                claim,
                to: receipt.to,
                verified,
            },
            Err(error) => Mailed::Decided(error.disposition()),
        }
    }

    /// Records every mail the relay accepted in one statement. If it fails, their claims keep
    /// their leases and the retries find the mails at the relay, as after a crash.
    async fn record_batch(&self, mailed: Vec<Mailed>) -> Vec<Disposition> {
        let sent: Vec<&Claim> = mailed
            .iter()
            .filter_map(|one| match one {
                Mailed::Sent { claim, .. } => Some(claim),
                Mailed::Decided(_) => None,
            })
            .collect();
        let recorded = if sent.is_empty() {
            Ok(HashSet::new())
        } else {
            self.record_all(&sent).await
        };
        mailed
            .into_iter()
            .map(|one| match (one, &recorded) {
                (Mailed::Decided(disposition), _) => disposition,
                (Mailed::Sent { claim, to, verified }, Ok(released)) => {
                    claim.report_recorded(released.contains(&claim.ride_id));
                    tracing::info!(ride_id = claim.ride_id, to = %redact::email(&to), "receipt sent");
                    Disposition::Sent { verified }
                }
                (Mailed::Sent { .. }, Err(reason)) => Disposition::Retry(reason.clone()),
            })
            .collect()
    }

    async fn record_all(&self, sent: &[&Claim]) -> Result<HashSet<i64>, String> {
        let recorded = async {
            let mut conn = self.pool.get().await?;
            let released = claims::record_all(&mut conn, sent, RECORDED_VIA_SMTP).await?;
            Ok::<_, HandleError>(released.into_iter().collect())
        };
        recorded.await.map_err(|error| error.to_string())
    }
}
