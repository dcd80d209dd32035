//! What a state-changing admin command reports: each change it makes (or would make), printed
//! before it is applied, and the transaction it runs in (read-only for a dry run).

use std::fmt::Write as _;

use diesel_async::AsyncPgConnection;
use serde::Serialize;

use super::*;

/// One change a command makes (or would make), as printed before it is applied.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Change {
    /// `update` or `insert`.
    pub action: &'static str,
    pub table: &'static str,
    /// The row's id; `None` for a row that is yet to be inserted.
    pub row: Option<i64>,
    /// The column updated; `None` for an insert.
    pub column: Option<&'static str>,
    pub from: Option<serde_json::Value>,
    pub to: serde_json::Value,
}

impl Change {
    pub fn update(
        table: &'static str,
        row: i64,
        column: &'static str,
        from: serde_json::Value,
        to: serde_json::Value,
    ) -> Change {
        Change {
            action: "update",
            table,
            row: Some(row),
            column: Some(column),
            from: Some(from),
            to,
        }
    }

    pub fn insert(table: &'static str, values: serde_json::Value) -> Change {
        Change {
            action: "insert",
            table,
            row: None,
            column: None,
            from: None,
            to: values,
        }
    }
}

/// What a state-changing database command did or would do.
#[derive(Clone, Debug, Serialize)]
pub struct ChangeReport {
    pub command: &'static str,
    pub mode: Mode,
    /// The row the command is about (key id, or attention row id).
    pub target: i64,
    pub changes: Vec<Change>,
    pub warnings: Vec<String>,
    /// Facts the operator should see next to the changes (the outcome a replay will return, …).
    pub notes: Vec<String>,
}

impl ChangeReport {
    pub fn new(command: &'static str, mode: Mode, target: i64) -> ChangeReport {
        ChangeReport {
            command,
            mode,
            target,
            changes: Vec::new(),
            warnings: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// The transaction a change runs in: READ COMMITTED, and read-only for a dry run, so that a
/// dry run can take no lock and write nothing whatever its statements are.
pub(crate) fn change_transaction(
    conn: &mut AsyncPgConnection,
    mode: Mode,
) -> diesel_async::pg::TransactionBuilder<'_, AsyncPgConnection> {
    let transaction = conn.build_transaction().read_committed();
    if mode.applies() {
        transaction
    } else {
        transaction.read_only()
    }
}

/// An operator's resolution note: 1 to 2000 characters, not only blanks.
pub(crate) fn check_note(note: &str) -> Result<(), AdminError> {
    if note.trim().is_empty() || note.chars().count() > 2000 {
        return Err(AdminError::Invalid(
            "--note must be 1 to 2000 characters".into(),
        ));
    }
    Ok(())
}

impl ChangeReport {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let heading = match self.mode {
            Mode::DryRun => "DRY RUN, nothing changed",
            Mode::Apply => "APPLIED",
        };
        let _ = writeln!(out, "{} {}: {heading}", self.command, self.target);
        for warning in &self.warnings {
            let _ = writeln!(out, "WARNING: {warning}");
        }
        let _ = writeln!(
            out,
            "{}",
            match self.mode {
                Mode::DryRun => "Would change:",
                Mode::Apply => "Changed:",
            }
        );
        for change in &self.changes {
            let row = change
                .row
                .map_or_else(String::new, |row| format!("[{row}]"));
            match (change.column, &change.from) {
                (Some(column), Some(from)) => {
                    let _ = writeln!(
                        out,
                        "  {} {}{row}.{column}: {from} -> {}",
                        change.action, change.table, change.to
                    );
                }
                _ => {
                    let _ = writeln!(
                        out,
                        "  {} {}{row}: {}",
                        change.action, change.table, change.to
                    );
                }
            }
        }
        for note in &self.notes {
            let _ = writeln!(out, "Note: {note}");
        }
        if self.mode == Mode::DryRun {
            let _ = writeln!(out, "Re-run with --yes to apply.");
        }
        out
    }
}
