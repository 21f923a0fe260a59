//! The DynamoDB backend URL: `dynamodb://TABLE?region=REGION&endpoint=URL&create=true&index=NAME`,
//! with the document model's settings `revs_limit=N` (revision ids remembered per document,
//! default 1000), `settle_ms=N` (how far behind "now" the change feed reads, default 5000) and
//! `write_timeout_ms=N` (the limit of one write attempt, default 2000, below `settle_ms`); see
//! docs/dynamodb-layout.md for what the last two guarantee. `count_max_age_ms=N` (default 60000,
//! `0` for never) is the most a database table's exact document count is served again, each time
//! only after a check that no write or erasure landed since (docs/databases.md, "Document counts").
//!
//! The table defaults to `agent_data_store` and the GSI to `idx-user-namespace`. Credentials come
//! from the standard AWS chain (environment, profile, SSO, container and instance roles); the
//! region from `region=` or that chain. `endpoint=` points at a local server (DynamoDB Local,
//! dynalite, moto). Tables are created (on-demand billing) only with `create=true`.

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;

use crate::backend::url::query::{decode, url_error, QueryParams};
use crate::error::Result;

/// How errors name this adapter's URL.
const ADAPTER: &str = "DynamoDB";

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

pub const DEFAULT_TABLE: &str = crate::model::COLLECTION;
pub const DEFAULT_INDEX: &str = "idx-user-namespace";
/// How far behind the reader's clock the change feed reads by default.
pub const DEFAULT_SETTLE: Duration = Duration::from_millis(5000);
/// The default limit of one write attempt (stamping its feed position to its answer).
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_millis(2000);

/// The most an exact count of a database table is served again by default (`count_max_age_ms`;
/// the count itself is `ids.rs`'s, remembered by `raw::count_cache`). Each use is checked first
/// (`count_check.rs`: the feed's latest entries and the purge trace), so another process's write
/// shows at the next request whatever the age; the age only bounds how long an unseen failure of
/// that check (a write stamped more than `settle_ms` late) could last.
pub const DEFAULT_COUNT_MAX_AGE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamoConfig {
    pub table: String,
    pub index: String,
    pub region: Option<String>,
    pub endpoint: Option<String>,
    pub create: bool,
    /// Revision ids remembered per document.
    pub revs_limit: usize,
    /// The change feed reads only positions at least this old by the reader's clock.
    pub settle: Duration,
    /// One write attempt is abandoned (and retried with a fresh feed position) after this.
    pub write_timeout: Duration,
    /// The most an exact document count is served again, each use checked first
    /// (`count_max_age_ms`); zero for never.
    pub count_max_age: Duration,
    /// Whether the table carries the user/namespace GSI (`index`): the data-store table does
    /// and must; a database table of the catalog ([`super::catalog`]) does not, since only the
    /// data-store database answers the facade's listings. Without it the table is created with
    /// no such index, opens without one, and `query` is refused. Not a URL setting.
    pub user_index: bool,
}

impl DynamoConfig {
    pub fn parse(text: &str) -> Result<Self> {
        let bad = |problem: String| url_error(ADAPTER, problem);
        let rest = text.strip_prefix("dynamodb://").ok_or_else(|| bad("must start with dynamodb://".into()))?;
        let (table, query) = rest.split_once('?').unwrap_or((rest, ""));
        let table = table.trim_end_matches('/');
        let table = if table.is_empty() { DEFAULT_TABLE.to_owned() } else { decode(table) };
        check_table_name(&table).map_err(bad)?;
        let params = QueryParams::parse(
            ADAPTER,
            query,
            &[
                "region",
                "endpoint",
                "create",
                "index",
                "revs_limit",
                "settle_ms",
                "write_timeout_ms",
                "count_max_age_ms",
            ],
        )?;
        let index = match params.text("index") {
            Some(index) => {
                check_table_name(index).map_err(bad)?;
                index.to_owned()
            }
            None => DEFAULT_INDEX.into(),
        };
        // Durations are whole milliseconds from 1 to u32::MAX, as before.
        let millis = |name: &str, default: Duration| -> Result<Duration> {
            Ok(params.whole(name, 1..=u64::from(u32::MAX))?.map_or(default, Duration::from_millis))
        };
        let config = DynamoConfig {
            table,
            index,
            region: params.text("region").filter(|v| !v.is_empty()).map(str::to_owned),
            endpoint: params.url("endpoint")?,
            create: params.flag("create")?.unwrap_or(false),
            revs_limit: params.revs_limit(u32::MAX as usize)?,
            settle: millis("settle_ms", DEFAULT_SETTLE)?,
            write_timeout: millis("write_timeout_ms", DEFAULT_WRITE_TIMEOUT)?,
            count_max_age: params
                .whole("count_max_age_ms", 0..=u64::from(u32::MAX))?
                .map_or(DEFAULT_COUNT_MAX_AGE, Duration::from_millis),
            user_index: true,
        };
        if config.write_timeout >= config.settle {
            return Err(bad(format!(
                "write_timeout_ms ({}) must be below settle_ms ({}): a write attempt must end before the change feed \
                 reads past its position",
                config.write_timeout.as_millis(),
                config.settle.as_millis()
            )));
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

/// DynamoDB's rule for table and index names: 3–255 of `a-z A-Z 0-9 _ - .`.
pub(super) fn check_table_name(name: &str) -> std::result::Result<(), String> {
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
        assert_eq!((c.revs_limit, c.settle, c.write_timeout), (1000, DEFAULT_SETTLE, DEFAULT_WRITE_TIMEOUT));
        let c = DynamoConfig::parse("dynamodb://t11?revs_limit=50&settle_ms=800&write_timeout_ms=300").unwrap();
        assert_eq!(c.revs_limit, 50);
        assert_eq!(c.settle, Duration::from_millis(800));
        assert_eq!(c.write_timeout, Duration::from_millis(300));
        assert_eq!(c.count_max_age, super::DEFAULT_COUNT_MAX_AGE);
        let c = DynamoConfig::parse("dynamodb://t11?count_max_age_ms=0").unwrap();
        assert_eq!(c.count_max_age, Duration::ZERO);
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
            "dynamodb://t11?revs_limit=0",
            "dynamodb://t11?revs_limit=ten",
            "dynamodb://t11?settle_ms=1000&write_timeout_ms=1000",
            "dynamodb://t11?count_max_age_ms=-1",
        ] {
            assert!(DynamoConfig::parse(bad).is_err(), "{bad}");
        }
    }
}
