//! The DynamoDB backend URL: `dynamodb://TABLE?region=REGION&endpoint=URL&create=true&index=NAME`.
//!
//! The table defaults to `agent_data_store` and the GSI to `idx-user-namespace`. Credentials come
//! from the standard AWS chain (environment, profile, SSO, container and instance roles); the
//! region from `region=` or that chain. `endpoint=` points at a local server (DynamoDB Local,
//! dynalite, moto). Tables are created (on-demand billing) only with `create=true`.

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;

use crate::error::{Error, Result};

/// The SDK owns the retries of every DynamoDB request (nothing in the adapter retries a failed
/// request again): this many attempts, with jittered backoff from 100 ms up to 2 s.
pub const SDK_ATTEMPTS: u32 = 4;
/// Everything one DynamoDB operation may take, all its attempts included: a DynamoDB that is down
/// or unreachable is reported within this bound.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);

/// The SDK's retry configuration: the one owner of retries for DynamoDB requests.
pub fn sdk_retry_config() -> RetryConfig {
    RetryConfig::standard()
        .with_max_attempts(SDK_ATTEMPTS)
        .with_initial_backoff(Duration::from_millis(100))
        .with_max_backoff(Duration::from_secs(2))
}

/// The SDK's timeouts: connecting, each attempt, and the whole operation.
pub fn sdk_timeout_config() -> TimeoutConfig {
    TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(5))
        .operation_attempt_timeout(Duration::from_secs(20))
        .operation_timeout(OPERATION_TIMEOUT)
        .build()
}

pub const DEFAULT_TABLE: &str = "agent_data_store";
pub const DEFAULT_INDEX: &str = "idx-user-namespace";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamoConfig {
    pub table: String,
    pub index: String,
    pub region: Option<String>,
    pub endpoint: Option<String>,
    pub create: bool,
}

impl DynamoConfig {
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |problem: String| Error::invalid("backend", format!("DynamoDB URL: {problem}"));
        let rest = text.strip_prefix("dynamodb://").ok_or_else(|| bad("must start with dynamodb://".into()))?;
        let (table, query) = rest.split_once('?').unwrap_or((rest, ""));
        let table = table.trim_end_matches('/');
        let table = if table.is_empty() { DEFAULT_TABLE.to_owned() } else { decode(table) };
        check_table_name(&table).map_err(bad)?;
        let mut config =
            DynamoConfig { table, index: DEFAULT_INDEX.into(), region: None, endpoint: None, create: false };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = decode(value);
            match name {
                "region" => config.region = Some(value).filter(|v| !v.is_empty()),
                "endpoint" => {
                    url::Url::parse(&value).map_err(|e| bad(format!("endpoint {value:?}: {e}")))?;
                    config.endpoint = Some(value);
                }
                "create" => {
                    config.create = match value.as_str() {
                        "true" | "1" | "yes" => true,
                        "false" | "0" | "no" => false,
                        _ => return Err(bad(format!("create={value} is not true/false"))),
                    }
                }
                "index" => {
                    check_table_name(&value).map_err(bad)?;
                    config.index = value;
                }
                other => {
                    return Err(bad(format!("unknown parameter {other:?} (known: region, endpoint, create, index)")))
                }
            }
        }
        Ok(config)
    }

    pub fn redacted(&self) -> String {
        let mut out = format!("dynamodb://{}", self.table);
        let mut params = Vec::new();
        if let Some(region) = &self.region {
            params.push(format!("region={region}"));
        }
        if let Some(endpoint) = &self.endpoint {
            params.push(format!("endpoint={endpoint}"));
        }
        if !params.is_empty() {
            out.push('?');
            out.push_str(&params.join("&"));
        }
        out
    }
}

fn decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text).decode_utf8_lossy().into_owned()
}

/// DynamoDB's rule for table and index names: 3–255 of `a-z A-Z 0-9 _ - .`.
fn check_table_name(name: &str) -> std::result::Result<(), String> {
    if (3..=255).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
        Ok(())
    } else {
        Err(format!("{name:?} is not a valid DynamoDB table or index name (3-255 of a-z A-Z 0-9 _ - .)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let c = DynamoConfig::parse(
            "dynamodb://my_table?region=eu-west-1&endpoint=http%3A%2F%2F127.0.0.1%3A8000&create=true",
        )
        .unwrap();
        assert_eq!(c.table, "my_table");
        assert_eq!(c.region.as_deref(), Some("eu-west-1"));
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:8000"));
        assert!(c.create);
        assert_eq!(c.index, DEFAULT_INDEX);
        let c = DynamoConfig::parse("dynamodb://?endpoint=http://localhost:4567").unwrap();
        assert_eq!(c.table, DEFAULT_TABLE);
        assert_eq!(c.endpoint.as_deref(), Some("http://localhost:4567"));
        assert_eq!(c.redacted(), "dynamodb://agent_data_store?endpoint=http://localhost:4567");
    }

    #[test]
    fn refuses_bad_urls() {
        for bad in [
            "dynamo://t",
            "dynamodb://a",
            "dynamodb://bad name",
            "dynamodb://t1?create=perhaps",
            "dynamodb://t1?x=1",
            "dynamodb://t1?endpoint=not a url",
        ] {
            assert!(DynamoConfig::parse(bad).is_err(), "{bad}");
        }
    }
}
