//! Timestamps: written as ISO 8601 UTC with second precision (`2026-02-05T10:00:00Z`, the form
//! the spec's documents use); any RFC 3339 form is accepted when reading, and
//! [`read_timestamp`] reads the looser forms stored documents may carry.

use chrono::{DateTime, NaiveDate, NaiveDateTime, SecondsFormat, Utc};
use serde_json::Value;

use crate::error::{Error, Result};

/// The form every timestamp we write has.
pub fn format(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The current time in the written form.
pub fn now() -> String {
    format(Utc::now())
}

/// Parses any RFC 3339 timestamp (offsets, fractional seconds, `z` or `Z`) into UTC.
pub fn parse(text: &str) -> Result<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| Error::invalid("timestamp", format!("{text:?} is not RFC 3339: {e}")))
}

/// Parses an RFC 3339 timestamp into UTC, `None` when it is not one (what [`parse`] accepts).
pub fn parse_exact(text: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text).ok().map(|t| t.with_timezone(&Utc))
}

/// Reads a stored timestamp by the first rule that applies, and names the rule: RFC 3339, ISO
/// 8601 without an offset (as UTC), a date (midnight UTC), Unix seconds or milliseconds. The
/// migration normalises what this reads; the model accepts what it reads as a timestamp field.
pub fn read_timestamp(stored: &Value) -> Option<(DateTime<Utc>, &'static str)> {
    match stored {
        Value::String(text) => {
            let text = text.trim();
            if let Some(at) = parse_exact(text) {
                return Some((at, "timestamp_normalised"));
            }
            // ISO 8601 without an offset is what Python's `datetime.utcnow().isoformat()` writes:
            // read as UTC.
            for pattern in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M"] {
                if let Ok(naive) = NaiveDateTime::parse_from_str(text, pattern) {
                    return Some((naive.and_utc(), "timestamp_naive_as_utc"));
                }
            }
            // A space instead of `T` before an explicit offset.
            if let Some(at) = text.get(10..11).filter(|sep| *sep == " ").and_then(|_| {
                let mut with_t = text.to_owned();
                with_t.replace_range(10..11, "T");
                parse_exact(&with_t)
            }) {
                return Some((at, "timestamp_normalised"));
            }
            NaiveDate::parse_from_str(text, "%Y-%m-%d")
                .ok()
                .and_then(|date| date.and_hms_opt(0, 0, 0))
                .map(|naive| (naive.and_utc(), "timestamp_date_as_midnight_utc"))
        }
        Value::Number(number) => {
            // Unix time: seconds, or milliseconds when the magnitude says so (1e11 seconds is
            // the year 5138; 1e11 milliseconds is 1973).
            let seconds = number.as_f64()?;
            let seconds = if seconds.abs() >= 1e11 { seconds / 1000.0 } else { seconds };
            if !seconds.is_finite() {
                return None;
            }
            let whole = seconds.floor();
            let nanos = ((seconds - whole) * 1e9).round().min(999_999_999.0) as u32;
            DateTime::from_timestamp(whole as i64, nanos).map(|at| (at, "timestamp_from_unix_time"))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_spec_form() {
        let t = parse("2026-02-05T10:00:00.123456Z").unwrap();
        assert_eq!(format(t), "2026-02-05T10:00:00Z");
        assert!(now().ends_with('Z') && now().len() == 20);
    }

    #[test]
    fn reads_any_rfc3339() {
        let expected = parse("2026-02-05T10:00:00Z").unwrap();
        for text in [
            "2026-02-05T10:00:00Z",
            "2026-02-05T10:00:00z",
            "2026-02-05T10:00:00+00:00",
            "2026-02-05T11:30:00+01:30",
            "2026-02-05T05:00:00-05:00",
            "2026-02-05T10:00:00.000Z",
        ] {
            assert_eq!(parse(text).unwrap(), expected, "{text}");
        }
        assert!(parse("2026-02-05 10:00").is_err());
        assert!(parse("yesterday").is_err());
    }
}
