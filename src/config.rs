//! Settings: defaults, then a TOML file, then `AGENTSTORE_*` environment variables, then
//! command-line flags, each overriding the one before (the `config` crate does the layering).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::backend::url::DEFAULT_BACKEND_URL;
use crate::backend::BackendUrl;
use crate::error::{Error, ErrorKind, Result};
use crate::model::validate::DEFAULT_MAX_VALUE_BYTES;
use crate::model::Limits;
use crate::store::StoreOptions;

/// The config file read when present and no other is named.
pub const DEFAULT_CONFIG_FILE: &str = "agentstore.toml";

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Everything configurable. Field names are the config file keys and, upper-cased with the
/// `AGENTSTORE_` prefix, the environment variables (`AGENTSTORE_BACKEND`, …).
#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    /// Backend URL, e.g. `embedded:./data/agentstore.redb`.
    pub backend: String,
    /// Largest accepted value, in bytes of compact JSON.
    pub max_value_bytes: usize,
    /// Whether `get` counts reads as accesses (writes `accessCount`).
    pub track_reads: bool,
    /// Retries of a read-modify-write that meets a concurrent writer.
    pub max_conflict_retries: usize,
    /// Documents per backend query page.
    pub page_size: usize,
    /// `text` or `json` logs on stderr.
    pub log_format: LogFormat,
    /// Address `serve` listens on.
    pub listen: String,
    /// Bearer tokens `serve` accepts, by SHA-256 hash (see [`TokenSetting`]).
    #[serde(default)]
    pub tokens: TokensSetting,
    /// Allow `serve` to listen beyond loopback with no tokens configured.
    pub allow_unauthenticated: bool,
    /// Largest request body `serve` reads; default 4 × `max_value_bytes` + 64 KiB (a value and
    /// its metadata, with room for whitespace).
    pub max_body_bytes: Option<usize>,
    /// Document operations give up at this deadline before their next attempt (503, nothing
    /// applied); any request still running at twice it is cut with 504.
    pub request_timeout_secs: u64,
    /// On SIGTERM/SIGINT, how long in-flight requests may take to finish.
    pub shutdown_grace_secs: u64,
    /// CouchDB user, when the backend URL carries none.
    pub couchdb_user: Option<String>,
    /// CouchDB password, when the backend URL carries none.
    pub couchdb_password: Option<String>,
}

/// Tokens: in a config file a list of `{ sha256 = "…", user = "…" }` or
/// `{ sha256 = "…", admin = true }` tables; in the environment (`AGENTSTORE_TOKENS`) a
/// comma-separated list of `SCOPE:SHA256`, where SCOPE is a user id or `*` for admin.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokensSetting {
    List(Vec<TokenSetting>),
    Compact(String),
}

impl Default for TokensSetting {
    fn default() -> Self {
        TokensSetting::List(Vec::new())
    }
}

/// One accepted token: the hex SHA-256 of the token, and the one user it may act for (or admin).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct TokenSetting {
    pub sha256: String,
    pub user: Option<String>,
    #[serde(default)]
    pub admin: bool,
}

impl TokensSetting {
    /// The tokens as a list, whichever form they were given in.
    pub fn entries(&self) -> Result<Vec<TokenSetting>> {
        match self {
            TokensSetting::List(list) => Ok(list.clone()),
            TokensSetting::Compact(text) => text
                .split(',')
                .map(str::trim)
                .filter(|entry| !entry.is_empty())
                .map(|entry| {
                    let (scope, sha256) = entry.rsplit_once(':').ok_or_else(|| {
                        Error::invalid("tokens", "entries must be SCOPE:SHA256 (SCOPE a user id or *)")
                    })?;
                    Ok(TokenSetting {
                        sha256: sha256.to_owned(),
                        user: (scope != "*").then(|| scope.to_owned()),
                        admin: scope == "*",
                    })
                })
                .collect(),
        }
    }
}

/// Values given on the command line; `None` leaves the lower layers' value.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub backend: Option<String>,
    pub max_value_bytes: Option<usize>,
    pub log_format: Option<LogFormat>,
    pub listen: Option<String>,
    pub allow_unauthenticated: Option<bool>,
}

impl Settings {
    /// Loads the layers. `file` must exist when given; otherwise `agentstore.toml` is read if it
    /// is in the working directory.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Self> {
        let bad = |e: config::ConfigError| Error::new(ErrorKind::InvalidInput, format!("configuration: {e}"));
        let mut builder = config::Config::builder()
            .set_default("backend", DEFAULT_BACKEND_URL)
            .and_then(|b| b.set_default("max_value_bytes", DEFAULT_MAX_VALUE_BYTES as u64))
            .and_then(|b| b.set_default("track_reads", true))
            .and_then(|b| b.set_default("max_conflict_retries", StoreOptions::default().max_conflict_retries as u64))
            .and_then(|b| b.set_default("page_size", StoreOptions::default().page_size as u64))
            .and_then(|b| b.set_default("log_format", "text"))
            .and_then(|b| b.set_default("listen", "127.0.0.1:8080"))
            .and_then(|b| b.set_default("allow_unauthenticated", false))
            .and_then(|b| b.set_default("request_timeout_secs", 30u64))
            .and_then(|b| b.set_default("shutdown_grace_secs", 30u64))
            .map_err(bad)?;
        builder = match file {
            Some(path) => {
                if !path.exists() {
                    return Err(Error::invalid("config", format!("file {} does not exist", path.display())));
                }
                builder.add_source(config::File::from(path.to_path_buf()).format(config::FileFormat::Toml))
            }
            None => builder.add_source(
                config::File::from(PathBuf::from(DEFAULT_CONFIG_FILE)).format(config::FileFormat::Toml).required(false),
            ),
        };
        builder = builder.add_source(config::Environment::with_prefix("AGENTSTORE").try_parsing(true));
        if let Some(backend) = &overrides.backend {
            builder = builder.set_override("backend", backend.as_str()).map_err(bad)?;
        }
        if let Some(max) = overrides.max_value_bytes {
            builder = builder.set_override("max_value_bytes", max as u64).map_err(bad)?;
        }
        if let Some(format) = overrides.log_format {
            let name = match format {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            };
            builder = builder.set_override("log_format", name).map_err(bad)?;
        }
        if let Some(listen) = &overrides.listen {
            builder = builder.set_override("listen", listen.as_str()).map_err(bad)?;
        }
        if let Some(allow) = overrides.allow_unauthenticated {
            builder = builder.set_override("allow_unauthenticated", allow).map_err(bad)?;
        }
        let settings: Settings = builder.build().and_then(|c| c.try_deserialize()).map_err(bad)?;
        if settings.page_size == 0 {
            return Err(Error::invalid("page_size", "must be at least 1"));
        }
        if settings.max_value_bytes == 0 {
            return Err(Error::invalid("max_value_bytes", "must be at least 1"));
        }
        Ok(settings)
    }

    /// The backend URL, with credentials from the settings filled in where the URL has none.
    pub fn backend_url(&self) -> Result<BackendUrl> {
        self.resolve_backend_url(&self.backend)
    }

    /// Parses a backend URL (the configured one, or one named on the command line, as `migrate`
    /// does), with credentials from the settings filled in where the URL has none.
    pub fn resolve_backend_url(&self, text: &str) -> Result<BackendUrl> {
        let mut url: BackendUrl = text.parse()?;
        if let BackendUrl::CouchDb(config) = &mut url {
            if config.user.is_none() {
                config.user = self.couchdb_user.clone();
                config.password = self.couchdb_password.clone();
            }
        }
        Ok(url)
    }

    /// The request body limit in force.
    pub fn body_limit(&self) -> usize {
        self.max_body_bytes.unwrap_or_else(|| self.max_value_bytes.saturating_mul(4).saturating_add(64 * 1024))
    }

    /// The facade's options these settings describe.
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            limits: Limits { max_value_bytes: self.max_value_bytes },
            track_reads: self.track_reads,
            max_conflict_retries: self.max_conflict_retries,
            page_size: self.page_size,
            deadline: None,
        }
    }
}
