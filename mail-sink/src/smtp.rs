//! One SMTP session: the commands lettre sends, DATA with dot-unstuffing, and the failures the
//! sink can be told to answer with. With TLS ([`SinkTls`]) the plain listener offers STARTTLS and
//! the `smtps` listener speaks TLS from the first byte; AUTH PLAIN is offered only over TLS, and
//! credentials sent without it are refused and recorded ([`Login`]), so a test can prove that
//! none ever crossed in the clear.

use std::path::Path;

use base64::Engine;
use tokio::{
    io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader},
    net::TcpStream,
};

use crate::*;

/// Longest accepted command line and mail; both are generous for receipts.
pub(crate) const MAX_LINE: usize = 4096;
pub(crate) const MAX_MESSAGE: usize = 10 * 1024 * 1024;

/// Where a conversation stands as to TLS.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Channel {
    Plain,
    /// Upgraded by STARTTLS: the client speaks first (EHLO), there is no new greeting.
    StartedTls,
    /// `smtps`: TLS from the first byte.
    ImplicitTls,
}

/// How a conversation ended.
enum Ended<S> {
    Closed,
    /// The client asked for STARTTLS and was told to go ahead: the raw stream, for the handshake.
    StartTls(S),
}

/// One conversation on the plain listener, upgraded by STARTTLS when the client asks.
pub(crate) async fn session(
    stream: TcpStream,
    state: &State,
    dir: Option<&Path>,
) -> std::io::Result<()> {
    let Ended::StartTls(raw) = conversation(stream, state, dir, Channel::Plain).await? else {
        return Ok(());
    };
    // STARTTLS is only taken when the sink has TLS.
    let Some(tls) = &state.tls else {
        return Ok(());
    };
    let stream = tls.acceptor().accept(raw).await?;
    conversation(stream, state, dir, Channel::StartedTls)
        .await
        .map(|_| ())
}

/// One conversation on the `smtps` listener.
pub(crate) async fn smtps_session(
    stream: TcpStream,
    tls: &SinkTls,
    state: &State,
    dir: Option<&Path>,
) -> std::io::Result<()> {
    let stream = tls.acceptor().accept(stream).await?;
    conversation(stream, state, dir, Channel::ImplicitTls)
        .await
        .map(|_| ())
}

async fn reply<S: AsyncWrite + Unpin>(conn: &mut S, text: &[u8]) -> std::io::Result<()> {
    conn.write_all(text).await?;
    conn.flush().await
}

async fn conversation<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    state: &State,
    dir: Option<&Path>,
    channel: Channel,
) -> std::io::Result<Ended<S>> {
    let secure = channel != Channel::Plain;
    let mut conn = BufReader::new(stream);
    if channel != Channel::StartedTls {
        reply(&mut conn, b"220 mail-sink ESMTP ready\r\n").await?;
    }
    let mut mail_from: Option<String> = None;
    let mut rcpt_to: Vec<String> = Vec::new();
    let mut line = String::new();
    loop {
        let Some(verb) = read_command(&mut conn, &mut line).await? else {
            return Ok(Ended::Closed);
        };
        let command = line.trim_end_matches(['\r', '\n']).to_owned();
        let answer: &[u8] = match verb.as_str() {
            "EHLO" | "HELO" => {
                mail_from = None;
                rcpt_to.clear();
                match (secure, state.tls.is_some()) {
                    (true, _) => b"250-mail-sink\r\n250 AUTH PLAIN\r\n",
                    (false, true) => b"250-mail-sink\r\n250 STARTTLS\r\n",
                    (false, false) => b"250 mail-sink\r\n",
                }
            }
            "STARTTLS" if secure => b"503 5.5.1 TLS already active\r\n",
            "STARTTLS" if state.tls.is_some() => {
                // Anything the client sent after STARTTLS was sent in the clear and must not be
                // taken as said over TLS (the STARTTLS command injection): refuse and hang up.
                if !conn.buffer().is_empty() {
                    reply(&mut conn, b"501 5.5.4 nothing may follow STARTTLS\r\n").await?;
                    return Ok(Ended::Closed);
                }
                reply(&mut conn, b"220 2.0.0 ready to start TLS\r\n").await?;
                return Ok(Ended::StartTls(conn.into_inner()));
            }
            "AUTH" => {
                let text = authenticate(&mut conn, &command, secure, state).await?;
                reply(&mut conn, text).await?;
                continue;
            }
            "MAIL" => match address_after(&command, "FROM:") {
                Some(address) => {
                    mail_from = Some(address);
                    rcpt_to.clear();
                    b"250 2.1.0 OK\r\n"
                }
                None => b"501 5.5.4 syntax: MAIL FROM:<address>\r\n",
            },
            "RCPT" => match (&mail_from, address_after(&command, "TO:")) {
                (None, _) => b"503 5.5.1 MAIL first\r\n",
                (Some(_), Some(address)) => {
                    rcpt_to.push(address);
                    b"250 2.1.5 OK\r\n"
                }
                (Some(_), None) => b"501 5.5.4 syntax: RCPT TO:<address>\r\n",
            },
            "DATA" => {
                let envelope = (&mut mail_from, &mut rcpt_to);
                receive_data(&mut conn, state, dir, envelope, secure).await?;
                continue;
            }
            "RSET" => {
                mail_from = None;
                rcpt_to.clear();
                b"250 2.0.0 OK\r\n"
            }
            "NOOP" => b"250 2.0.0 OK\r\n",
            "VRFY" => b"252 2.5.2 cannot verify\r\n",
            "QUIT" => {
                reply(&mut conn, b"221 2.0.0 bye\r\n").await?;
                return Ok(Ended::Closed);
            }
            _ => b"502 5.5.2 command not implemented\r\n",
        };
        reply(&mut conn, answer).await?;
    }
}

/// DATA: refused unless MAIL and RCPT came first; otherwise the message after `354` is read and
/// delivered to the envelope's recipients (or refused as too big), and the envelope emptied.
async fn receive_data<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut BufReader<S>,
    state: &State,
    dir: Option<&Path>,
    (mail_from, rcpt_to): (&mut Option<String>, &mut Vec<String>),
    secure: bool,
) -> std::io::Result<()> {
    let Some(from) = mail_from.take().filter(|_| !rcpt_to.is_empty()) else {
        return reply(conn, b"503 5.5.1 MAIL and RCPT first\r\n").await;
    };
    reply(conn, b"354 end with <CRLF>.<CRLF>\r\n").await?;
    let data = read_data(conn).await?;
    let rcpt_to = std::mem::take(rcpt_to);
    let text = match data {
        None => "552 5.3.4 message too big\r\n".to_owned(),
        Some(data) => {
            let mail = ReceivedMail {
                mail_from: from,
                rcpt_to,
                data,
                over_tls: secure,
            };
            deliver(state, dir, mail).await?
        }
    };
    reply(conn, text.as_bytes()).await
}

/// `AUTH PLAIN [initial-response]` (RFC 4954, RFC 4616): any user and password are accepted
/// over TLS, and each is recorded with whether TLS carried it; without TLS the credentials (if
/// the client sent them already) are recorded as sent in the clear and refused.
async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut BufReader<S>,
    command: &str,
    secure: bool,
    state: &State,
) -> std::io::Result<&'static [u8]> {
    let mut words = command.split_whitespace().skip(1);
    let mechanism = words.next().unwrap_or_default().to_ascii_uppercase();
    let initial = words.next().map(str::to_owned);
    if !secure {
        if let Some(initial) = initial {
            state.login(Login {
                user: plain_user(&initial).unwrap_or_default(),
                over_tls: false,
            });
        }
        return Ok(b"538 5.7.11 encryption required for authentication\r\n");
    }
    if mechanism != "PLAIN" {
        return Ok(b"504 5.5.4 unrecognized authentication type\r\n");
    }
    let response = match initial {
        Some(initial) => initial,
        None => {
            reply(conn, b"334 \r\n").await?;
            let mut line = String::new();
            if read_command(conn, &mut line).await?.is_none() {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            line.trim_end_matches(['\r', '\n']).to_owned()
        }
    };
    match plain_user(&response) {
        Some(user) => {
            state.login(Login {
                user,
                over_tls: true,
            });
            Ok(b"235 2.7.0 authentication succeeded\r\n")
        }
        None => Ok(b"501 5.5.2 cannot decode the response\r\n"),
    }
}

/// The authentication identity of a SASL PLAIN response (`authzid NUL authcid NUL password`,
/// base64); `None` unless it decodes to that shape.
fn plain_user(response: &str) -> Option<String> {
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(response.trim())
        .ok()?;
    let mut parts = decoded.split(|byte| *byte == 0);
    let (_authzid, authcid, _password) = (parts.next()?, parts.next()?, parts.next()?);
    String::from_utf8(authcid.to_vec()).ok()
}

/// Reads the next command line into `line` (at most [`MAX_LINE`] bytes) and returns its verb in
/// upper case; `None` once the client has closed the connection.
async fn read_command<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut String,
) -> std::io::Result<Option<String>> {
    line.clear();
    let read = reader.take(MAX_LINE as u64).read_line(line).await?;
    if read == 0 {
        return Ok(None);
    }
    let verb = line.split_whitespace().next().unwrap_or_default();
    Ok(Some(verb.to_ascii_uppercase()))
}

/// A complete mail: refused as the next injected failure says, or (after any injected delay)
/// kept, stored in `dir` when given, and announced to waiters. Returns the reply.
async fn deliver(state: &State, dir: Option<&Path>, mail: ReceivedMail) -> std::io::Result<String> {
    if let Some(code) = state.next_failure() {
        return Ok(format!("{code} injected failure, try again\r\n"));
    }
    if let Some(delay) = state.next_slow_accept() {
        tokio::time::sleep(delay).await;
    }
    if let Some(dir) = dir {
        store(dir, &mail).await?;
    }
    state.keep(mail);
    state.received.notify_waiters();
    Ok("250 2.0.0 queued\r\n".to_owned())
}

/// Reads DATA up to the lone dot, undoing dot-stuffing. `None` if the message is too big (the
/// rest is still consumed so the conversation stays in step).
pub(crate) async fn read_data<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
) -> std::io::Result<Option<String>> {
    let mut data = String::new();
    let mut too_big = false;
    let mut raw = Vec::new();
    loop {
        raw.clear();
        let read = reader.read_until(b'\n', &mut raw).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let line = String::from_utf8_lossy(&raw);
        let line = line.trim_end_matches(['\r', '\n']);
        if line == "." {
            return Ok((!too_big).then_some(data));
        }
        let line = line.strip_prefix('.').unwrap_or(line);
        if data.len() + line.len() > MAX_MESSAGE {
            too_big = true;
            continue;
        }
        if !data.is_empty() {
            data.push_str("\r\n");
        }
        data.push_str(line);
    }
}

/// `MAIL FROM:<a@b> BODY=8BITMIME` → `a@b`.
pub(crate) fn address_after(command: &str, keyword: &str) -> Option<String> {
    let upper = command.to_ascii_uppercase();
    let start = upper.find(keyword)? + keyword.len();
    let rest = command[start..].trim_start();
    let rest = rest.strip_prefix('<')?;
    let end = rest.find('>')?;
    Some(rest[..end].to_owned())
}
