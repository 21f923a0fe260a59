//! Timestamps: written as ISO 8601 UTC with second precision (`2026-02-05T10:00:00Z`, the form
//! the spec's documents use); any RFC 3339 form is accepted when reading.

use chrono::{DateTime, SecondsFormat, Utc};

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
