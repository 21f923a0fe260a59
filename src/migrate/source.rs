//! Where a migration reads from: a backend's full scan, or an NDJSON file. Either yields pages of
//! documents together with the [`Position`] just after the page, which the checkpoint records.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checkpoint::io_error;
use crate::backend::{DocumentBackend, Revision, StoredDocument};
use crate::error::{Error, ErrorKind, Result};
use crate::model::fields;

/// Longest NDJSON line read: a document at the largest value and metadata sizes, with room.
pub const MAX_LINE_BYTES: u64 = 64 * 1024 * 1024;

/// A resumable place in the source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Position {
    /// Nothing read yet.
    Start,
    /// A backend scan continues with this page token.
    Scan { token: String },
    /// An NDJSON file continues at this byte offset, which starts line `line` (1-based).
    File { offset: u64, line: u64 },
    /// The source is exhausted.
    End,
}

/// One item read from the source.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    Document(StoredDocument),
    /// An NDJSON line that is not a JSON object with a string `_id`.
    Unreadable {
        location: String,
        reason: String,
    },
}

/// One page and where the source continues after it.
#[derive(Debug)]
pub struct SourcePage {
    pub items: Vec<Incoming>,
    pub position: Position,
}

/// A source opened at a position.
pub enum Source {
    Backend { backend: Arc<dyn DocumentBackend>, token: Option<String>, done: bool },
    File { reader: Option<Box<LineReader>>, done: bool },
}

impl Source {
    /// A backend's scan, continued from `position`.
    pub fn backend(backend: Arc<dyn DocumentBackend>, position: &Position) -> Result<Self> {
        let (token, done) = match position {
            Position::Start => (None, false),
            Position::Scan { token } => (Some(token.clone()), false),
            Position::End => (None, true),
            Position::File { .. } => {
                return Err(Error::invalid("checkpoint", "holds a file position, but the source is a backend"))
            }
        };
        Ok(Source::Backend { backend, token, done })
    }

    /// An NDJSON file, continued from `position`.
    pub fn file(path: &Path, position: &Position) -> Result<Self> {
        let (offset, line, done) = match position {
            Position::Start => (0, 1, false),
            Position::File { offset, line } => (*offset, *line, false),
            Position::End => (0, 1, true),
            Position::Scan { .. } => {
                return Err(Error::invalid("checkpoint", "holds a scan position, but the source is a file"))
            }
        };
        let reader = LineReader::open(path, offset, line)?;
        Ok(Source::File { reader: Some(Box::new(reader)), done })
    }

    /// The next page of at most `limit` items, or `None` at the end.
    pub async fn next_page(&mut self, limit: usize) -> Result<Option<SourcePage>> {
        match self {
            Source::Backend { backend, token, done } => {
                if *done {
                    return Ok(None);
                }
                // Pages may come back empty but unfinished (a page of design documents): go on.
                loop {
                    let page = backend.scan(limit, token.as_deref()).await?;
                    if page.next.is_some() && page.next == *token {
                        return Err(Error::new(
                            ErrorKind::Internal,
                            format!(
                                "{} returned the scan token it was given; the scan would not end",
                                backend.describe()
                            ),
                        ));
                    }
                    *token = page.next;
                    let position = match token {
                        Some(token) => Position::Scan { token: token.clone() },
                        None => {
                            *done = true;
                            Position::End
                        }
                    };
                    if !page.items.is_empty() || *done {
                        let items = page.items.into_iter().map(Incoming::Document).collect();
                        return Ok(Some(SourcePage { items, position }));
                    }
                }
            }
            Source::File { reader, done } => {
                if *done {
                    return Ok(None);
                }
                let mut taken = reader
                    .take()
                    .ok_or_else(|| Error::new(ErrorKind::Internal, "NDJSON reader lost after a failed read"))?;
                let (taken, page) = tokio::task::spawn_blocking(move || {
                    let page = taken.read_page(limit);
                    (taken, page)
                })
                .await
                .map_err(|e| Error::new(ErrorKind::Internal, "NDJSON reader task failed").with_source(e))?;
                let page = page?;
                *reader = Some(taken);
                *done = page.position == Position::End;
                Ok(Some(page))
            }
        }
    }
}

/// Reads an NDJSON file line by line, keeping the byte offset of the next line.
pub struct LineReader {
    path: PathBuf,
    reader: BufReader<File>,
    offset: u64,
    line: u64,
    buffer: Vec<u8>,
}

impl LineReader {
    fn open(path: &Path, offset: u64, line: u64) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| io_error(path, "open", e))?;
        let length = file.metadata().map_err(|e| io_error(path, "stat", e))?.len();
        if offset > length {
            return Err(Error::invalid(
                "checkpoint",
                format!("says {} was read up to byte {offset}, but it has {length} bytes", path.display()),
            ));
        }
        file.seek(SeekFrom::Start(offset)).map_err(|e| io_error(path, "seek in", e))?;
        Ok(LineReader { path: path.to_path_buf(), reader: BufReader::new(file), offset, line, buffer: Vec::new() })
    }

    fn read_page(&mut self, limit: usize) -> Result<SourcePage> {
        let mut items = Vec::new();
        while items.len() < limit.max(1) {
            self.buffer.clear();
            let read = Read::take(&mut self.reader, MAX_LINE_BYTES + 1)
                .read_until(b'\n', &mut self.buffer)
                .map_err(|e| io_error(&self.path, "read", e))?;
            if read == 0 {
                return Ok(SourcePage { items, position: Position::End });
            }
            if read as u64 > MAX_LINE_BYTES {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!("{} line {} is over {MAX_LINE_BYTES} bytes", self.path.display(), self.line),
                ));
            }
            let location = format!("line {}", self.line);
            self.offset += read as u64;
            self.line += 1;
            let text = self.buffer.trim_ascii();
            if text.is_empty() {
                continue;
            }
            items.push(parse_line(text, location));
        }
        Ok(SourcePage { items, position: Position::File { offset: self.offset, line: self.line } })
    }
}

/// One NDJSON line in the spec's document shape: `_id`, optionally `_rev`, and the body.
fn parse_line(text: &[u8], location: String) -> Incoming {
    let unreadable = |reason: String| Incoming::Unreadable { location: location.clone(), reason };
    let mut object = match serde_json::from_slice::<Value>(text) {
        Ok(Value::Object(object)) => object,
        Ok(other) => return unreadable(format!("is JSON but not an object ({})", json_kind(&other))),
        Err(e) => return unreadable(format!("is not JSON: {e}")),
    };
    let id = match object.remove(fields::ID) {
        Some(Value::String(id)) => id,
        Some(other) => return unreadable(format!("has an _id that is not a string ({})", json_kind(&other))),
        None => return unreadable("has no _id".into()),
    };
    let rev = match object.remove(fields::REV) {
        Some(Value::String(rev)) => rev,
        _ => String::new(),
    };
    Incoming::Document(StoredDocument { id, rev: Revision(rev), body: object })
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reads_ndjson_in_pages_and_resumes_at_the_recorded_offset() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("in.ndjson");
        let lines = [
            r#"{"_id":"u:ns:YQ==","_rev":"1-a","value":1}"#,
            "",
            "not json",
            r#"{"_id":"u:ns:Yg==","value":2}"#,
            r#"[1]"#,
            r#"{"_id":"u:ns:Yw==","value":3}"#,
        ];
        std::fs::write(&path, lines.join("\n")).expect("write");
        let mut source = Source::file(&path, &Position::Start).expect("open");
        let first = source.next_page(2).await.expect("read").expect("page");
        assert_eq!(first.items.len(), 2);
        assert!(matches!(&first.items[0], Incoming::Document(d) if d.id == "u:ns:YQ==" && d.rev.0 == "1-a"
            && !d.body.contains_key("_id")));
        assert!(matches!(&first.items[1], Incoming::Unreadable { location, .. } if location == "line 3"));
        // A new reader at the recorded position continues exactly there.
        let mut resumed = Source::file(&path, &first.position).expect("reopen");
        let rest = resumed.next_page(10).await.expect("read").expect("page");
        assert_eq!(rest.position, Position::End);
        let ids: Vec<String> = rest
            .items
            .iter()
            .map(|item| match item {
                Incoming::Document(doc) => doc.id.clone(),
                Incoming::Unreadable { location, .. } => location.clone(),
            })
            .collect();
        assert_eq!(ids, ["u:ns:Yg==", "line 5", "u:ns:Yw=="]);
        assert!(resumed.next_page(10).await.expect("read").is_none());
    }

    #[test]
    fn refuses_an_offset_past_the_end() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("in.ndjson");
        std::fs::write(&path, "{}\n").expect("write");
        let err = Source::file(&path, &Position::File { offset: 10, line: 2 }).err().expect("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
    }
}
