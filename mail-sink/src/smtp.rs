//! One SMTP session: the commands lettre sends, DATA with dot-unstuffing, and the failures the
//! sink can be told to answer with.

use std::path::Path;

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

use crate::*;

/// Longest accepted command line and mail; both are generous for receipts.
pub(crate) const MAX_LINE: usize = 4096;
pub(crate) const MAX_MESSAGE: usize = 10 * 1024 * 1024;

/// One SMTP conversation.
pub(crate) async fn session(
    stream: TcpStream,
    state: &State,
    dir: Option<&Path>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    write.write_all(b"220 mail-sink ESMTP ready\r\n").await?;
    let mut mail_from: Option<String> = None;
    let mut rcpt_to: Vec<String> = Vec::new();
    let mut line = String::new();
    loop {
        let Some(verb) = read_command(&mut reader, &mut line).await? else {
            return Ok(());
        };
        let command = line.trim_end_matches(['\r', '\n']);
        let reply: &[u8] = match verb.as_str() {
            "EHLO" | "HELO" => {
                mail_from = None;
                rcpt_to.clear();
                b"250 mail-sink\r\n"
            }
            "MAIL" => match address_after(command, "FROM:") {
                Some(address) => {
                    mail_from = Some(address);
                    rcpt_to.clear();
                    b"250 2.1.0 OK\r\n"
                }
                None => b"501 5.5.4 syntax: MAIL FROM:<address>\r\n",
            },
            "RCPT" => match (&mail_from, address_after(command, "TO:")) {
                (None, _) => b"503 5.5.1 MAIL first\r\n",
                (Some(_), Some(address)) => {
                    rcpt_to.push(address);
                    b"250 2.1.5 OK\r\n"
                }
                (Some(_), None) => b"501 5.5.4 syntax: RCPT TO:<address>\r\n",
            },
            "DATA" => {
                let Some(from) = mail_from.take().filter(|_| !rcpt_to.is_empty()) else {
                    write
                        .write_all(b"503 5.5.1 MAIL and RCPT first\r\n")
                        .await?;
                    continue;
                };
                write.write_all(b"354 end with <CRLF>.<CRLF>\r\n").await?;
                let data = read_data(&mut reader).await?;
                let rcpt_to = std::mem::take(&mut rcpt_to);
                let reply = match data {
                    None => "552 5.3.4 message too big\r\n".to_owned(),
                    Some(data) => {
                        let mail = ReceivedMail {
                            mail_from: from,
                            rcpt_to,
                            data,
                        };
                        deliver(state, dir, mail).await?
                    }
                };
                write.write_all(reply.as_bytes()).await?;
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
                write.write_all(b"221 2.0.0 bye\r\n").await?;
                return Ok(());
            }
            _ => b"502 5.5.2 command not implemented\r\n",
        };
        write.write_all(reply).await?;
    }
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
