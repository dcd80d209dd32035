-- A receipt being sent. The claim is committed before the SMTP conversation starts and deleted in
-- the transaction that writes sent_receipts, so a crash after the relay accepted the mail but
-- before it was recorded leaves a claim behind. The next attempt at that ride then asks the relay
-- whether it holds the Message-ID before sending again (see docs/workers.md, "the crash window").
CREATE TABLE receipt_claims (
    ride_id       BIGINT      PRIMARY KEY REFERENCES rides ON DELETE CASCADE,
    -- How many attempts have claimed this ride. More than one means an earlier attempt may have
    -- handed the mail to the relay. It also fences: only the latest claimant may record the send.
    attempts      INT         NOT NULL DEFAULT 1 CHECK (attempts >= 1),
    -- Until when the claimant may still be talking to the relay; another attempt waits until then.
    claimed_until TIMESTAMPTZ NOT NULL,
    message_id    TEXT        NOT NULL CHECK (char_length(message_id) <= 255),
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- How a sent receipt came to be recorded: by the attempt that sent it, or by a later attempt that
-- found the earlier attempt's mail at the relay.
ALTER TABLE sent_receipts
    ADD COLUMN recorded_via TEXT NOT NULL DEFAULT 'smtp'
        CHECK (recorded_via IN ('smtp', 'relay_search'));
