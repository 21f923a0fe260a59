//! Settings: defaults, then a TOML file, then `AGENTSTORE_*` environment variables, then
//! command-line flags, each overriding the one before (the `config` crate does the layering).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::backend::url::DEFAULT_BACKEND_URL;
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
}

/// Values given on the command line; `None` leaves the lower layers' value.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub backend: Option<String>,
    pub max_value_bytes: Option<usize>,
    pub log_format: Option<LogFormat>,
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
            .map_err(bad)?;
        builder = match file {
            Some(path) => {
                if !path.exists() {
                    return Err(Error::invalid("config", format!("file {} does not exist", path.display())));
                }
                builder.add_source(config::File::from(path.to_path_buf()))
            }
            None => builder.add_source(config::File::from(PathBuf::from(DEFAULT_CONFIG_FILE)).required(false)),
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
        let settings: Settings = builder.build().and_then(|c| c.try_deserialize()).map_err(bad)?;
        if settings.page_size == 0 {
            return Err(Error::invalid("page_size", "must be at least 1"));
        }
        if settings.max_value_bytes == 0 {
            return Err(Error::invalid("max_value_bytes", "must be at least 1"));
        }
        Ok(settings)
    }

    /// The facade's options these settings describe.
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            limits: Limits { max_value_bytes: self.max_value_bytes },
            track_reads: self.track_reads,
            max_conflict_retries: self.max_conflict_retries,
            page_size: self.page_size,
        }
    }
}
