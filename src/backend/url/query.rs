//! The query part of every backend URL (`?name=value&…`), parsed once for all four adapters:
//! split on `&`, percent-decoded, checked against the adapter's known parameters, then read
//! through typed accessors. Every error names the adapter and the parameter in one style:
//! `invalid backend: DynamoDB URL: settle_ms=0 is not a whole number from 1 to 4294967295`.
//!
//! It imports no adapter, so each adapter's `config.rs` may use it while `url.rs` (which
//! dispatches to those configs) stays above them.

use std::ops::RangeInclusive;

use crate::error::{Error, Result};

/// An error about one adapter's URL, in the shared style: `invalid backend: <Adapter> URL: …`.
pub fn url_error(adapter: &str, problem: impl std::fmt::Display) -> Error {
    Error::invalid("backend", format!("{adapter} URL: {problem}"))
}

/// Percent-decodes one URL part (`+` stays `+`: these are not form-encoded).
pub fn decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text).decode_utf8_lossy().into_owned()
}

/// `(name, value)` of each non-empty `&`-separated part, decoded; `None` where there is no `=`.
pub fn split_pairs(query: &str) -> Vec<(String, Option<String>)> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) => (decode(name), Some(decode(value))),
            None => (decode(pair), None),
        })
        .collect()
}

/// The parameters of one backend URL, every name known to its adapter.
#[derive(Debug)]
pub struct QueryParams {
    /// How errors name the URL (`CouchDB`, `DynamoDB`, `Firestore`, `embedded`).
    adapter: &'static str,
    /// `(name, decoded value)` in the order given; a name without `=` has the value `""`.
    pairs: Vec<(String, String)>,
}

impl QueryParams {
    /// Splits `query` (without the `?`) and refuses a parameter not in `known`.
    pub fn parse(adapter: &'static str, query: &str, known: &[&str]) -> Result<Self> {
        let pairs: Vec<(String, String)> =
            split_pairs(query).into_iter().map(|(name, value)| (name, value.unwrap_or_default())).collect();
        if let Some((unknown, _)) = pairs.iter().find(|(name, _)| !known.contains(&name.as_str())) {
            return Err(url_error(adapter, format!("unknown parameter {unknown:?} (known: {})", known.join(", "))));
        }
        Ok(QueryParams { adapter, pairs })
    }

    /// An error about this URL in the shared style.
    pub fn error(&self, problem: impl std::fmt::Display) -> Error {
        url_error(self.adapter, problem)
    }

    /// The value of `name` converted by `convert`; `what` says what it must be when it cannot be.
    /// A parameter given twice is checked both times and the last one counts, as when each
    /// adapter read its pairs in order.
    pub fn get<T>(&self, name: &str, what: &str, convert: impl Fn(&str) -> Option<T>) -> Result<Option<T>> {
        let mut found = None;
        for (_, value) in self.pairs.iter().filter(|(given, _)| given == name) {
            found = Some(convert(value).ok_or_else(|| self.error(format!("{name}={value} is not {what}")))?);
        }
        Ok(found)
    }

    /// The text of `name`, unchecked.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.pairs.iter().rev().find(|(given, _)| given == name).map(|(_, value)| value.as_str())
    }

    /// `true`/`1`/`yes` or `false`/`0`/`no`.
    pub fn flag(&self, name: &str) -> Result<Option<bool>> {
        self.get(name, "true/false", |value| match value {
            "true" | "1" | "yes" => Some(true),
            "false" | "0" | "no" => Some(false),
            _ => None,
        })
    }

    /// A whole number within `range`.
    pub fn whole(&self, name: &str, range: RangeInclusive<u64>) -> Result<Option<u64>> {
        let what = match (*range.start(), *range.end()) {
            (0, u64::MAX) => "a whole number".to_owned(),
            (least, u64::MAX) => format!("a whole number of at least {least}"),
            (least, most) => format!("a whole number from {least} to {most}"),
        };
        self.get(name, &what, |value| value.parse::<u64>().ok().filter(|n| range.contains(n)))
    }

    /// `revs_limit`: revision ids remembered per document, 1 to `most`, default
    /// [`crate::backend::DEFAULT_REVS_LIMIT`]. Every adapter reads it here.
    pub fn revs_limit(&self, most: usize) -> Result<usize> {
        let most = u64::try_from(most).unwrap_or(u64::MAX);
        let limit = self.whole("revs_limit", 1..=most)?;
        // The value is at most `most`, itself a usize, so it fits.
        Ok(limit.map_or(crate::backend::DEFAULT_REVS_LIMIT, |n| usize::try_from(n).unwrap_or(usize::MAX)))
    }

    /// An absolute URL (`endpoint=`), returned as given.
    pub fn url(&self, name: &str) -> Result<Option<String>> {
        self.get(name, "a URL", |value| url::Url::parse(value).ok().map(|_| value.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KNOWN: [&str; 4] = ["create", "revs_limit", "endpoint", "name"];

    fn parse(query: &str) -> Result<QueryParams> {
        QueryParams::parse("Test", query, &KNOWN)
    }

    #[test]
    fn reads_typed_values() {
        let params = parse("create=yes&revs_limit=7&endpoint=http%3A%2F%2Fh%3A1&name=a%20b&&").unwrap();
        assert_eq!(params.flag("create").unwrap(), Some(true));
        assert_eq!(params.revs_limit(10).unwrap(), 7);
        assert_eq!(params.url("endpoint").unwrap().as_deref(), Some("http://h:1"));
        assert_eq!(params.text("name"), Some("a b"));
        let empty = parse("").unwrap();
        assert_eq!(empty.flag("create").unwrap(), None);
        assert_eq!(empty.revs_limit(10).unwrap(), crate::backend::DEFAULT_REVS_LIMIT);
    }

    /// Every error names the adapter, and the parameter (with its value, or the known ones).
    #[test]
    fn errors_name_the_parameter_in_one_style() {
        let err = parse("nope=1").unwrap_err().to_string();
        assert_eq!(
            err,
            r#"invalid backend: Test URL: unknown parameter "nope" (known: create, revs_limit, endpoint, name)"#
        );
        let err = parse("create=maybe").unwrap().flag("create").unwrap_err().to_string();
        assert_eq!(err, "invalid backend: Test URL: create=maybe is not true/false");
        let err = parse("revs_limit=11").unwrap().revs_limit(10).unwrap_err().to_string();
        assert_eq!(err, "invalid backend: Test URL: revs_limit=11 is not a whole number from 1 to 10");
        let err = parse("revs_limit=0").unwrap().revs_limit(usize::MAX).unwrap_err().to_string();
        assert_eq!(err, "invalid backend: Test URL: revs_limit=0 is not a whole number of at least 1");
        let err = parse("endpoint=not a url").unwrap().url("endpoint").unwrap_err().to_string();
        assert_eq!(err, "invalid backend: Test URL: endpoint=not a url is not a URL");
    }

    /// A parameter given twice is checked both times; the last one counts.
    #[test]
    fn repeated_parameters_are_all_checked() {
        assert_eq!(parse("revs_limit=2&revs_limit=3").unwrap().revs_limit(10).unwrap(), 3);
        assert!(parse("revs_limit=0&revs_limit=3").unwrap().revs_limit(10).is_err());
    }
}
