//! A replication's checkpoints as CouchDB 3.4.3's replicator keeps them
//! (`couch_replicator_scheduler_job`): the same `_local/{base id}` document on the source and the
//! target, `{session_id, source_last_seq, replication_id_version, history: [...]}` with at most
//! 50 history entries, newest first, each naming its session and the sequence it recorded. A job
//! starts from the source's `source_last_seq` when both documents carry the same session, else
//! from the newest history entry both share (`compare_replication_logs`), else from the start.

use serde_json::{json, Map, Value};

use super::ids::{ReplicationId, REPLICATION_ID_VERSION};
use super::job::JobStats;
use crate::migrate::deployment::Side;
use crate::Result;

/// History entries kept (CouchDB's 50).
const MAX_HISTORY: usize = 50;

/// Where a job starts and what it writes its checkpoints over.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    name: String,
    session_id: String,
    /// The sequence this session started from.
    pub start_seq: Value,
    history: Vec<Value>,
    source_rev: Option<String>,
    target_rev: Option<String>,
    /// When this session started (RFC 1123, as CouchDB writes it).
    start_time: String,
    /// Whether `doc_ids` is set (CouchDB then writes a few more fields at the top).
    by_doc_ids: bool,
    /// The sequence last recorded.
    pub recorded: Value,
    /// The session the source's checkpoint named when the job started, if any.
    found_session: Option<Value>,
    /// The body this session last recorded.
    last_recorded: Option<Map<String, Value>>,
}

/// One end of a replication: a side and a database on it.
pub struct End<'a> {
    pub side: &'a Side,
    pub db: &'a str,
}

impl Checkpoints {
    /// Reads both checkpoint documents and decides where to start; `since_seq` (the
    /// replication's option) wins over them, as in CouchDB.
    pub async fn read(
        source: &End<'_>,
        target: &End<'_>,
        id: &ReplicationId,
        since_seq: Option<&Value>,
        by_doc_ids: bool,
    ) -> Result<Self> {
        let name = id.checkpoint_name().to_owned();
        let source_log = source.side.get_local(source.db, &name).await?;
        let target_log = target.side.get_local(target.db, &name).await?;
        let (found_seq, history) = match (&source_log, &target_log) {
            (Some(source_log), Some(target_log)) => compare_logs(source_log, target_log),
            _ => (Value::from(0), Vec::new()),
        };
        let start_seq = since_seq.cloned().unwrap_or(found_seq);
        let rev = |log: &Option<Map<String, Value>>| log.as_ref().and_then(|l| l["_rev"].as_str().map(str::to_owned));
        let found_session = match (&source_log, &target_log) {
            (Some(log), Some(_)) if !history.is_empty() => log.get("session_id").cloned(),
            _ => None,
        };
        Ok(Checkpoints {
            session_id: random_hex()?,
            recorded: start_seq.clone(),
            start_seq,
            history,
            source_rev: rev(&source_log),
            target_rev: rev(&target_log),
            start_time: rfc1123_now(),
            by_doc_ids,
            name,
            found_session,
            last_recorded: None,
        })
    }

    /// The counts of the newest history entry kept, as statistics: a job's counts go on from
    /// them, as CouchDB's (`init_state`: the larger of the job's own and the history's).
    pub fn history_stats(&self) -> JobStats {
        let Some(entry) = self.history.first() else { return JobStats::default() };
        let count = |field: &str| entry.get(field).and_then(Value::as_u64).unwrap_or(0);
        JobStats {
            revisions_checked: count("missing_checked"),
            missing_revisions_found: count("missing_found"),
            docs_read: count("docs_read"),
            docs_written: count("docs_written"),
            doc_write_failures: count("doc_write_failures"),
            bulk_get_docs: count("bulk_get_docs"),
            bulk_get_attempts: count("bulk_get_attempts"),
            ..JobStats::default()
        }
    }

    /// Records `seq` (every change through it copied) on the target, then on the source.
    pub async fn record(&mut self, source: &End<'_>, target: &End<'_>, seq: &Value, stats: &JobStats) -> Result<()> {
        if *seq == self.recorded {
            return Ok(());
        }
        let end_time = rfc1123_now();
        let entry = json!({
            "session_id": self.session_id,
            "start_time": self.start_time,
            "end_time": end_time,
            "start_last_seq": self.start_seq,
            "end_last_seq": seq,
            "recorded_seq": seq,
            "missing_checked": stats.revisions_checked,
            "missing_found": stats.missing_revisions_found,
            "docs_read": stats.docs_read,
            "docs_written": stats.docs_written,
            "doc_write_failures": stats.doc_write_failures,
            "bulk_get_docs": stats.bulk_get_docs,
            "bulk_get_attempts": stats.bulk_get_attempts,
        });
        let mut body = Map::new();
        body.insert("session_id".into(), Value::from(self.session_id.clone()));
        body.insert("source_last_seq".into(), seq.clone());
        body.insert("replication_id_version".into(), Value::from(REPLICATION_ID_VERSION));
        if self.by_doc_ids {
            body.insert("start_time".into(), Value::from(self.start_time.clone()));
            body.insert("end_time".into(), Value::from(end_time));
            body.insert("docs_read".into(), Value::from(stats.docs_read));
            body.insert("docs_written".into(), Value::from(stats.docs_written));
            body.insert("doc_write_failures".into(), Value::from(stats.doc_write_failures));
        }
        let mut history = vec![entry];
        history.extend(self.history.iter().cloned());
        history.truncate(MAX_HISTORY);
        body.insert("history".into(), Value::Array(history));
        self.target_rev = Some(target.side.put_local(target.db, &self.name, self.target_rev.as_deref(), &body).await?);
        self.source_rev = Some(source.side.put_local(source.db, &self.name, self.source_rev.as_deref(), &body).await?);
        self.recorded = seq.clone();
        self.last_recorded = Some(body);
        Ok(())
    }

    /// A one-shot run's answer (`POST /_replicate`): the checkpoint this session last recorded
    /// (its whole history), or, when it recorded nothing new over an earlier checkpoint, that
    /// checkpoint's session and history with `no_changes: true`, as CouchDB answers.
    pub fn answer(&self) -> Value {
        let mut answer = Map::new();
        answer.insert("ok".into(), Value::Bool(true));
        match &self.last_recorded {
            Some(body) => answer.extend(body.clone()),
            // No checkpoint before either (an empty source): CouchDB's `{ok, no_changes}`.
            None if self.found_session.is_none() => {
                answer.insert("no_changes".into(), Value::Bool(true));
            }
            None => {
                answer.insert("no_changes".into(), Value::Bool(true));
                answer.insert("session_id".into(), self.found_session.clone().unwrap_or(Value::Null));
                answer.insert("source_last_seq".into(), self.recorded.clone());
                answer.insert("replication_id_version".into(), Value::from(REPLICATION_ID_VERSION));
                answer.insert("history".into(), Value::Array(self.history.clone()));
            }
        }
        Value::Object(answer)
    }
}

/// Where two checkpoint documents agree the source was copied through, and the history kept
/// (CouchDB's `compare_replication_logs` and `compare_rep_history`).
pub fn compare_logs(source: &Map<String, Value>, target: &Map<String, Value>) -> (Value, Vec<Value>) {
    let history = |log: &Map<String, Value>| log.get("history").and_then(Value::as_array).cloned().unwrap_or_default();
    if source.get("session_id").is_some() && source.get("session_id") == target.get("session_id") {
        let seq = source.get("source_last_seq").cloned().unwrap_or(Value::from(0));
        return (seq, history(source));
    }
    let (source_history, target_history) = (history(source), history(target));
    let has_session = |id: &Value, entries: &[Value]| entries.iter().any(|entry| entry.get("session_id") == Some(id));
    let (mut s, mut t) = (&source_history[..], &target_history[..]);
    while let (Some(first_s), Some(first_t)) = (s.first(), t.first()) {
        let source_id = first_s.get("session_id").cloned().unwrap_or(Value::Null);
        if has_session(&source_id, t) {
            let seq = first_s.get("recorded_seq").cloned().unwrap_or(Value::from(0));
            return (seq, s[1..].to_vec());
        }
        let target_id = first_t.get("session_id").cloned().unwrap_or(Value::Null);
        if has_session(&target_id, &s[1..]) {
            let seq = first_t.get("recorded_seq").cloned().unwrap_or(Value::from(0));
            return (seq, t[1..].to_vec());
        }
        s = &s[1..];
        t = &t[1..];
    }
    (Value::from(0), Vec::new())
}

/// A new session id (CouchDB's `couch_uuids:random()`: 32 hex digits).
pub fn random_hex() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| crate::Error::new(crate::ErrorKind::Internal, format!("no random session id: {e}")))?;
    Ok(hex::encode(bytes))
}

/// Now as HTTP dates are written (CouchDB's `httpd_util:rfc1123_date`).
pub fn rfc1123_now() -> String {
    chrono::Utc::now().format("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    /// The same session: the source's sequence; different sessions: the newest entry both
    /// histories share, from either side; nothing shared: the start.
    #[test]
    fn where_two_checkpoints_agree() {
        let same = log(json!({"session_id": "a", "source_last_seq": "9-x", "history": [{"session_id": "a"}]}));
        assert_eq!(compare_logs(&same, &same).0, json!("9-x"));
        let source = log(json!({"session_id": "c", "history": [
            {"session_id": "c", "recorded_seq": "12-c"}, {"session_id": "b", "recorded_seq": "7-b"}]}));
        let target = log(json!({"session_id": "d", "history": [
            {"session_id": "d", "recorded_seq": "13-d"}, {"session_id": "b", "recorded_seq": "7-b"}]}));
        assert_eq!(compare_logs(&source, &target).0, json!("7-b"));
        let stranger = log(json!({"session_id": "z", "history": [{"session_id": "z", "recorded_seq": "1-z"}]}));
        assert_eq!(compare_logs(&source, &stranger), (json!(0), Vec::new()));
    }
}
