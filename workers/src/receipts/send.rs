//! One receipt, in named steps: what the message's ride is owed ([`Owed`]), the claim, whether
//! it was sent already, what became of an earlier attempt's mail ([`EarlierMail`]), and the send
//! with its record.

use contract::ReceiptJob;
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::RunQueryDsl;
use schema::{
    models::{RECORDED_VIA_RELAY_SEARCH, RECORDED_VIA_SMTP},
    schema::{rides, sent_receipts, users},
};
use tokio_util::sync::CancellationToken;

use super::{Disposition, HandleError, ReceiptWorker, claim::Claim};
use crate::{
    mailer::{MailError, Receipt},
    redact,
};

/// What the database says a message's ride is owed. The ride row is authoritative; the message
/// only names the ride.
pub(super) enum Owed {
    Receipt(Receipt),
    /// No receipt, and why: the message is dead-lettered.
    Nothing(String),
}

/// What is known of an earlier attempt's mail for a receipt this attempt is about to send.
pub(super) enum EarlierMail {
    /// No earlier attempt claimed it, or the relay holds no such mail.
    NotSent,
    /// The relay holds the earlier attempt's mail: recorded here, not sent again.
    FoundAtRelay,
    /// An earlier attempt may have sent it and no relay search is configured to say.
    Unknown,
}

impl ReceiptWorker {
    pub(super) async fn send_once(
        &self,
        job: &ReceiptJob,
        message_id: &str,
        shutdown: &CancellationToken,
    ) -> Result<Disposition, HandleError> {
        let receipt = match self.owed(job).await? {
            Owed::Receipt(receipt) => receipt,
            Owed::Nothing(reason) => return Ok(Disposition::DeadLetter(reason)),
        };
        let Some(claim) = self.claim(job.ride_id, message_id, shutdown).await? else {
            return Ok(Disposition::Retry(
                "shutting down while another attempt holds the receipt".into(),
            ));
        };
        if self.already_sent(&claim).await? {
            return Ok(Disposition::Duplicate);
        }
        let verified = match self.earlier_mail(&claim).await? {
            EarlierMail::FoundAtRelay => return Ok(Disposition::Recovered),
            EarlierMail::NotSent => true,
            EarlierMail::Unknown => false,
        };
        self.send(&claim, &receipt).await?;
        Ok(Disposition::Sent { verified })
    }

    /// What the message's ride is owed ([`owed_from`]).
    async fn owed(&self, job: &ReceiptJob) -> Result<Owed, HandleError> {
        let mut conn = self.pool.get().await?;
        let ride = rides::table
            .inner_join(users::table)
            .filter(rides::id.eq(job.ride_id))
            .select((
                rides::user_id,
                rides::amount,
                rides::currency,
                rides::stripe_charge_id,
                rides::created_at,
                users::email,
            ))
            .first::<RideRow>(&mut conn)
            .await
            .optional()?;
        Ok(owed_from(job, ride))
    }

    /// Whether the ride's receipt is recorded as sent; if so the claim is dropped.
    async fn already_sent(&self, claim: &Claim) -> Result<bool, HandleError> {
        let mut conn = self.pool.get().await?;
        let sent = sent_receipts::table
            .find(claim.ride_id)
            .select(sent_receipts::ride_id)
            .first::<i64>(&mut conn)
            .await
            .optional()?
            .is_some();
        if sent {
            claim.delete(&mut conn).await?;
            tracing::info!(
                ride_id = claim.ride_id,
                message_id = claim.message_id,
                "receipt already sent"
            );
        }
        Ok(sent)
    }

    /// An earlier attempt that claimed this receipt and never recorded it may have died after the
    /// relay accepted the mail: the relay's record decides, where a search is configured.
    pub(super) async fn earlier_mail(&self, claim: &Claim) -> Result<EarlierMail, HandleError> {
        if claim.attempts <= 1 {
            return Ok(EarlierMail::NotSent);
        }
        let Some(search) = &self.relay_search else {
            tracing::warn!(
                ride_id = claim.ride_id,
                attempts = claim.attempts,
                "an earlier attempt may have sent this receipt and MAIL_SEARCH_URL is unset, so \
                 it cannot be checked: sending again with the same Message-ID"
            );
            return Ok(EarlierMail::Unknown);
        };
        let message_id = crate::mailer::receipt_message_id(claim.ride_id);
        match search.holds(&message_id).await {
            Ok(true) => {
                let mut conn = self.pool.get().await?;
                claim
                    .record_sent(&mut conn, RECORDED_VIA_RELAY_SEARCH)
                    .await?;
                tracing::warn!(
                    ride_id = claim.ride_id,
                    attempts = claim.attempts,
                    "an earlier attempt's receipt was found at the relay; not sending again"
                );
                Ok(EarlierMail::FoundAtRelay)
            }
            Ok(false) => Ok(EarlierMail::NotSent),
            Err(error) => {
                self.end_lease(claim).await;
                Err(HandleError::Mail(MailError::Temporary(
                    telemetry::error_chain(&error),
                )))
            }
        }
    }

    /// Mails the receipt and records it (which releases the claim). A failure leaves the claim
    /// as the kind of failure requires.
    async fn send(&self, claim: &Claim, receipt: &Receipt) -> Result<(), HandleError> {
        self.mail(claim, receipt).await?;
        let mut conn = self.pool.get().await?;
        claim.record_sent(&mut conn, RECORDED_VIA_SMTP).await?;
        tracing::info!(
            ride_id = claim.ride_id,
            to = %redact::email(&receipt.to),
            "receipt sent"
        );
        Ok(())
    }

    /// Hands the mail to the relay over one of the mailer's connections, within the claim's
    /// lease; a failure leaves the claim as the kind of failure requires.
    pub(super) async fn mail(&self, claim: &Claim, receipt: &Receipt) -> Result<(), HandleError> {
        // Waiting for a connection may take a while under load; a conversation that could end
        // after the lease must not start, or a second attempt could send the receipt too.
        let _connection = self.mailer.connection().await;
        let sent = if tokio::time::Instant::now() + self.config.smtp_timeout >= claim.deadline {
            Err(MailError::Temporary(
                "no SMTP connection was free in time for the claim's lease".into(),
            ))
        } else {
            match tokio::time::timeout(self.config.smtp_timeout, self.mailer.send(receipt)).await {
                Ok(sent) => sent,
                Err(_) => Err(MailError::Unconfirmed(
                    "the SMTP conversation timed out".into(),
                )),
            }
        };
        let Err(error) = sent else {
            return Ok(());
        };
        match &error {
            // Refused outright: nothing reached the relay and the message leaves the queue.
            MailError::Permanent(_) => {
                if let Ok(mut conn) = self.pool.get().await {
                    let _ = claim.delete(&mut conn).await;
                }
            }
            MailError::Temporary(_) => self.end_lease(claim).await,
            // The relay may still be finishing the conversation this attempt left, and keep
            // the mail. The lease (longer than a conversation) is left to run out, so that
            // the retry asks the relay's search only after that: asked at once, it found
            // nothing and sent a second copy (long campaign 40d06df2, two rides).
            MailError::Unconfirmed(_) => {}
        }
        Err(error.into())
    }
}

/// A ride as a receipt needs it: user id, amount, currency, charge, creation time, and the
/// rider's address.
pub(super) type RideRow = (
    i64,
    i64,
    String,
    Option<String>,
    chrono::DateTime<chrono::Utc>,
    String,
);

/// What a job's ride is owed: nothing when the ride does not exist, is not the job's user's, or
/// does not record the job's charge.
pub(super) fn owed_from(job: &ReceiptJob, ride: Option<RideRow>) -> Owed {
    let Some((_, amount, currency, charge_id, created_at, email)) =
        ride.filter(|ride| ride.0 == job.user_id)
    else {
        return Owed::Nothing(format!(
            "unknown ride {} of user {}",
            job.ride_id, job.user_id
        ));
    };
    // A ride that records no charge was not paid (a charge never recorded, or refunded); one
    // that records another charge than the message's is not what the message was staged for.
    // A decoded receipt message always names a charge.
    let named = job.charge_id.as_deref().unwrap_or_default();
    let Some(charge_id) = charge_id else {
        return Owed::Nothing(format!(
            "ride {} records no charge (the message names {named})",
            job.ride_id
        ));
    };
    if charge_id != named {
        return Owed::Nothing(format!(
            "ride {} records charge {charge_id}, not the message's {named}",
            job.ride_id
        ));
    }
    Owed::Receipt(Receipt {
        ride_id: job.ride_id,
        to: email,
        amount,
        currency,
        charge_id,
        ride_created_at: created_at,
    })
}
