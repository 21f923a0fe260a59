//! The `agentstore` command line: global options, subcommands, and how their results and errors
//! reach the terminal (JSON on stdout; a message on stderr and a non-zero exit status on error).

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use serde_json::Value;

use crate::backend;
use crate::config::{LogFormat, Overrides, Settings};
use crate::error::{Error, ErrorKind, Result};
use crate::model::Limits;
use crate::store::DataStore;

/// Agents' key/value documents on CouchDB, DynamoDB, Firestore or an embedded file.
#[derive(Debug, Parser)]
#[command(name = "agentstore", version, about, long_about = None)]
pub struct Cli {
    /// Backend URL [default: embedded:./data/agentstore.redb; env: AGENTSTORE_BACKEND]
    #[arg(long, global = true, value_name = "URL")]
    pub backend: Option<String>,

    /// Config file (TOML) [default: ./agentstore.toml if present]
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Largest accepted value in bytes of JSON [default: 1048576; env: AGENTSTORE_MAX_VALUE_BYTES]
    #[arg(long, global = true, value_name = "BYTES")]
    pub max_value_bytes: Option<usize>,

    /// Log format on stderr [env: AGENTSTORE_LOG_FORMAT]
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    #[command(flatten)]
    Store(StoreCommand),
    /// Serve the data store as a JSON REST API (see /openapi.json)
    Serve {
        /// Address to listen on [default: 127.0.0.1:8080; env: AGENTSTORE_LISTEN]
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
        /// Allow listening beyond loopback with no tokens configured (anyone reaching it can read
        /// and write every user's data)
        #[arg(long)]
        allow_unauthenticated: bool,
        /// Seconds a client has to send a whole request head [default: 10; env:
        /// AGENTSTORE_HEADER_READ_TIMEOUT_SECS]
        #[arg(long, value_name = "SECS")]
        header_read_timeout_secs: Option<u64>,
        /// Seconds a connection may sit with nothing moving and no request handled before it is
        /// closed [default: 60; env: AGENTSTORE_IDLE_TIMEOUT_SECS]
        #[arg(long, value_name = "SECS")]
        idle_timeout_secs: Option<u64>,
        /// Connections served at once; more wait in the listen backlog [default: 1024; env:
        /// AGENTSTORE_MAX_CONNECTIONS]
        #[arg(long, value_name = "N")]
        max_connections: Option<usize>,
        /// Request-body bytes read and parsed at once, server-wide; more wait [default: 4 × the
        /// body limit; env: AGENTSTORE_MAX_INFLIGHT_BODY_BYTES]
        #[arg(long, value_name = "BYTES")]
        max_inflight_body_bytes: Option<usize>,
        /// Estimated memory of parsed request bodies held at once, server-wide; more wait
        /// [default: 134217728; env: AGENTSTORE_MAX_INFLIGHT_PARSE_BYTES]
        #[arg(long, value_name = "BYTES")]
        max_inflight_parse_bytes: Option<usize>,
        /// Also answer CouchDB's HTTP API on this address, over the same backend (see
        /// docs/couchdb-api.md) [env: AGENTSTORE_COUCHDB_LISTEN]
        #[arg(long, value_name = "ADDR")]
        couchdb_listen: Option<String>,
        /// The database name the CouchDB API serves [default: agent_data_store; env:
        /// AGENTSTORE_COUCHDB_DB]
        #[arg(long, value_name = "NAME")]
        couchdb_db: Option<String>,
    },
    /// Print the SHA-256 of a bearer token read from standard input, for the `tokens` setting
    HashToken,
    /// Print the Argon2id hash (PHC string) of a password read from standard input (without echo
    /// on a terminal), for the `couchdb_users` setting
    HashPassword,
    /// Copy every data-store document from one backend to another: resumable (checkpoint file),
    /// create-only at the target, final JSON report on stdout (see docs/migration.md)
    Migrate(crate::migrate::command::MigrateArgs),
    /// Compare two backends document by document (ids and content hashes); exit status 6 if they differ
    Verify(crate::migrate::command::VerifyArgs),
    /// Write every data-store document of a backend to an NDJSON file, one document per line
    Export(crate::migrate::command::ExportArgs),
    /// Write the documents of an NDJSON file (as `export` writes them) to a backend
    Import(crate::migrate::command::ImportArgs),
    /// Print the backend's change feed as NDJSON: one line per changed document (`seq`, `id`,
    /// `rev`, `deleted`), then `{"last_seq": …}`, the position to continue from with --since
    Changes(crate::feed::ChangesArgs),
    /// Bring a store written by an earlier release to this release's layout, in place: resumable
    /// (checkpoint file), idempotent, safe while the service runs; JSON report on stdout
    Upgrade(crate::upgrade::UpgradeArgs),
    /// Replace the CouchDB API's session secret kept in the backend (used when
    /// `couchdb_session_secret` is unset); sessions of the one replaced stay valid until the next
    /// rotation, and every `serve` over the backend signs with the new one within 30 seconds
    RotateSessionSecret,
}

/// The subcommands that use the store directly and print JSON.
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Create or update a document: the value is replaced, metadata merged into what is stored
    Set {
        user: String,
        namespace: String,
        key: String,
        /// The value as JSON; `-` reads it from standard input
        value_json: String,
        /// Metadata to merge, a JSON object
        #[arg(long, value_name = "JSON")]
        metadata: Option<String>,
        /// The agent writing
        #[arg(long, value_name = "NAME")]
        agent: Option<String>,
    },
    /// Print the stored document (the read counts as an access)
    Get {
        user: String,
        namespace: String,
        key: String,
        /// The agent reading
        #[arg(long, value_name = "NAME")]
        agent: Option<String>,
    },
    /// Delete a document
    Delete { user: String, namespace: String, key: String },
    /// Print whether a document exists (true/false; exit status 0 either way)
    Exists { user: String, namespace: String, key: String },
    /// Print a namespace's keys (a JSON array, sorted)
    Keys { user: String, namespace: String },
    /// Print a user's namespaces (a JSON array, sorted)
    Namespaces { user: String },
    /// Print a namespace's key → value object
    GetAll { user: String, namespace: String },
    /// Delete every document of a namespace
    DeleteNamespace { user: String, namespace: String },
    /// Delete everything a user owns (erasure request)
    PurgeUser { user: String },
}

impl Cli {
    pub fn overrides(&self) -> Overrides {
        let mut overrides = Overrides {
            backend: self.backend.clone(),
            max_value_bytes: self.max_value_bytes,
            log_format: self.log_format,
            ..Overrides::default()
        };
        if let Command::Serve {
            listen,
            allow_unauthenticated,
            header_read_timeout_secs,
            idle_timeout_secs,
            max_connections,
            max_inflight_body_bytes,
            max_inflight_parse_bytes,
            couchdb_listen,
            couchdb_db,
        } = &self.command
        {
            overrides.couchdb_listen = couchdb_listen.clone();
            overrides.couchdb_db = couchdb_db.clone();
            overrides.listen = listen.clone();
            overrides.allow_unauthenticated = allow_unauthenticated.then_some(true);
            overrides.header_read_timeout_secs = *header_read_timeout_secs;
            overrides.idle_timeout_secs = *idle_timeout_secs;
            overrides.max_connections = *max_connections;
            overrides.max_inflight_body_bytes = *max_inflight_body_bytes;
            overrides.max_inflight_parse_bytes = *max_inflight_parse_bytes;
        }
        overrides
    }
}

impl StoreCommand {
    /// Checks the names before any store is opened, so a typo neither creates a store file nor
    /// waits on a locked one.
    fn validate(&self, limits: &Limits) -> Result<()> {
        let (user, namespace, key) = match self {
            StoreCommand::Set { user, namespace, key, .. }
            | StoreCommand::Get { user, namespace, key, .. }
            | StoreCommand::Delete { user, namespace, key }
            | StoreCommand::Exists { user, namespace, key } => (user, Some(namespace), Some(key)),
            StoreCommand::Keys { user, namespace }
            | StoreCommand::GetAll { user, namespace }
            | StoreCommand::DeleteNamespace { user, namespace } => (user, Some(namespace), None),
            StoreCommand::Namespaces { user } | StoreCommand::PurgeUser { user } => (user, None, None),
        };
        limits.check_user_id(user)?;
        namespace.map(|ns| limits.check_namespace(ns)).transpose()?;
        key.map(|key| limits.check_key(key)).transpose()?;
        Ok(())
    }
}

/// Exit statuses, documented in docs/cli.md. Besides these, `verify` exits with
/// [`crate::migrate::EXIT_DIFFERENT`] (6) when the two sides differ, and `migrate`, `export` and
/// `import` with [`crate::migrate::EXIT_INCOMPLETE`] (7) when they finished but left documents
/// behind (malformed, refused by the target, unreadable lines; the report lists them).
pub fn exit_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::InvalidInput | ErrorKind::TooLarge | ErrorKind::Forbidden | ErrorKind::LoginRequired => 2,
        ErrorKind::NotFound => 3,
        ErrorKind::Conflict => 4,
        ErrorKind::Unavailable
        | ErrorKind::DeadlineExceeded
        | ErrorKind::OutcomeUnknown
        | ErrorKind::Unauthorized
        | ErrorKind::Misconfigured => 5,
        ErrorKind::Corrupt | ErrorKind::Internal => 1,
    }
}

/// Runs one subcommand; store subcommands print their JSON result. Returns the exit status of a
/// command that completed (0, or a migration command's own status).
pub async fn run(cli: Cli, settings: Settings) -> Result<u8> {
    match cli.command {
        Command::Migrate(args) => return crate::migrate::command::migrate(args, &settings).await,
        Command::Verify(args) => return crate::migrate::command::verify_command(args, &settings).await,
        Command::Export(args) => return crate::migrate::command::export(args, &settings).await,
        Command::Import(args) => return crate::migrate::command::import(args, &settings).await,
        Command::Changes(args) => {
            return crate::feed::run(open_existing_backend(&settings).await?, args).await.map(|()| 0)
        }
        Command::Upgrade(args) => {
            return crate::upgrade::run(open_existing_backend(&settings).await?, args).await.map(|()| 0)
        }
        Command::RotateSessionSecret => {
            let backend = open_existing_backend(&settings).await?;
            crate::couchdb_api::shared_secret::rotate(backend.as_ref()).await?;
            print_json(&serde_json::json!({ "ok": true }))?;
            return Ok(0);
        }
        Command::HashToken | Command::HashPassword | Command::Serve { .. } | Command::Store(_) => {}
    }
    run_service_command(cli.command, settings).await.map(|()| 0)
}

/// The commands that use the configured `--backend`.
async fn run_service_command(command: Command, settings: Settings) -> Result<()> {
    match command {
        Command::Migrate(_)
        | Command::Verify(_)
        | Command::Export(_)
        | Command::Import(_)
        | Command::Changes(_)
        | Command::RotateSessionSecret
        | Command::Upgrade(_) => Err(Error::new(ErrorKind::Internal, "this command is dispatched by run")),
        Command::HashToken => {
            let token = read_stdin(64 * 1024)?;
            let token = token.trim_end_matches(['\r', '\n']);
            if token.is_empty() {
                return Err(Error::invalid("token", "standard input is empty"));
            }
            println!("{}", crate::http::hash_token(token));
            Ok(())
        }
        Command::HashPassword => {
            println!("{}", crate::couchdb_api::auth::hash_password(&read_password()?)?);
            Ok(())
        }
        Command::Serve { .. } => serve(&settings).await,
        Command::Store(command) => {
            command.validate(&settings.store_options().limits)?;
            let url = settings.backend_url()?;
            let backend = backend::open(&url).await?;
            let store = DataStore::open(backend, settings.store_options()).await?;
            let output = execute(&store, command, settings.max_value_bytes).await?;
            print_json(&output)
        }
    }
}

/// Opens the configured `--backend` for a command that reads a store which must exist already
/// (opening a missing embedded file would create an empty store), and checks that it answers.
async fn open_existing_backend(settings: &Settings) -> Result<std::sync::Arc<dyn backend::DocumentBackend>> {
    let url = settings.backend_url()?;
    if let backend::BackendUrl::Embedded { path, .. } = &url {
        if !path.exists() {
            return Err(Error::invalid("backend", format!("{url}: the file does not exist")));
        }
    }
    let context = |err: Error| Error::new(err.kind(), format!("backend {url}")).with_source(err);
    let backend = backend::open(&url).await.map_err(context)?;
    backend.health().await.map_err(context)?;
    Ok(backend)
}

/// `serve`: opens the backend, binds, and serves until SIGTERM/SIGINT and the drain delay after it.
async fn serve(settings: &Settings) -> Result<()> {
    let url = settings.backend_url()?;
    let backend = backend::open(&url).await?;
    let describe = backend.describe();
    let app = crate::http::App::build(backend, settings).await?;
    let listener = crate::http::bind(&settings.listen, &app, settings.allow_unauthenticated).await?;
    let local = listener.local_addr().map_err(|e| Error::new(ErrorKind::Internal, "local address").with_source(e))?;
    let couchdb = match &settings.couchdb_listen {
        None => None,
        Some(listen) => {
            let options = crate::couchdb_api::CouchOptions { metrics: Some(app.metrics()) };
            let couch = crate::couchdb_api::CouchApp::build_with(app.store(), settings, options).await?;
            let listener = crate::couchdb_api::bind(listen, &couch, settings.allow_unauthenticated).await?;
            Some((couch, listener))
        }
    };
    tracing::info!(%local, backend = %describe, "agentstore serving");
    // Signal handlers first: a SIGTERM sent as soon as this line appears must still be graceful.
    let shutdown = crate::server::shutdown_signal();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    // At the signal both faces turn not ready; the listeners stop only after the drain delay.
    let faces = std::iter::once(app.draining()).chain(couchdb.as_ref().map(|(couch, _)| couch.draining())).collect();
    let drain = std::time::Duration::from_secs(settings.shutdown_drain_secs);
    tokio::spawn(async move {
        crate::server::drain_after_signal(shutdown, faces, drain).await;
        let _ = stop_tx.send(true);
    });
    eprintln!("agentstore: serving http://{local} on {describe}");
    let couchdb_task = match couchdb {
        None => None,
        Some((couch, listener)) => {
            let couch_local =
                listener.local_addr().map_err(|e| Error::new(ErrorKind::Internal, "local address").with_source(e))?;
            eprintln!("agentstore: serving the CouchDB API on http://{couch_local}/{}", settings.couchdb_db);
            let settings = settings.clone();
            let stop = stopped(stop_rx.clone());
            Some(tokio::spawn(async move { couch.serve(listener, &settings, stop).await }))
        }
    };
    app.serve(listener, stopped(stop_rx)).await?;
    if let Some(task) = couchdb_task {
        task.await.map_err(|e| Error::new(ErrorKind::Internal, "the CouchDB listener failed").with_source(e))??;
    }
    tracing::info!("stopped");
    Ok(())
}

async fn execute(store: &DataStore, command: StoreCommand, max_value_bytes: usize) -> Result<Value> {
    Ok(match command {
        StoreCommand::Set { user, namespace, key, value_json, metadata, agent } => {
            let value = if value_json == "-" {
                parse_json("value", &read_stdin(max_value_bytes)?)?
            } else {
                parse_json("value", &value_json)?
            };
            let metadata = metadata.map(|m| parse_json("metadata", &m)).transpose()?;
            store.set(&user, &namespace, &key, value, metadata, agent.as_deref()).await?.to_json()
        }
        StoreCommand::Get { user, namespace, key, agent } => store
            .get(&user, &namespace, &key, agent.as_deref())
            .await?
            .ok_or_else(|| not_found(&user, &namespace, &key))?
            .to_json(),
        StoreCommand::Delete { user, namespace, key } => {
            if !store.delete(&user, &namespace, &key).await? {
                return Err(not_found(&user, &namespace, &key));
            }
            serde_json::json!({ "deleted": true })
        }
        StoreCommand::Exists { user, namespace, key } => Value::Bool(store.exists(&user, &namespace, &key).await?),
        StoreCommand::Keys { user, namespace } => store.list_keys(&user, &namespace).await?.into(),
        StoreCommand::Namespaces { user } => store.list_namespaces(&user).await?.into(),
        StoreCommand::GetAll { user, namespace } => Value::Object(store.get_all(&user, &namespace).await?),
        StoreCommand::DeleteNamespace { user, namespace } => {
            serde_json::json!({ "deleted": store.delete_namespace(&user, &namespace).await? })
        }
        StoreCommand::PurgeUser { user } => {
            serde_json::json!({ "deleted": store.purge_user(&user).await? })
        }
    })
}

fn not_found(user: &str, namespace: &str, key: &str) -> Error {
    Error::not_found(format!("no document for user {user:?}, namespace {namespace:?}, key {key:?}"))
}

fn parse_json(field: &str, text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| Error::invalid(field, format!("is not valid JSON: {e}")))
}

/// Reads a value from stdin. JSON may carry whitespace the compact size does not count, so up to
/// four times the limit (plus 64 KiB) is read before refusing outright; the exact limit is then
/// checked on the parsed value.
fn read_stdin(max_value_bytes: usize) -> Result<String> {
    let cap = max_value_bytes.saturating_mul(4).saturating_add(64 * 1024);
    let mut text = String::new();
    std::io::stdin()
        .lock()
        .take(cap as u64 + 1)
        .read_to_string(&mut text)
        .map_err(|e| Error::invalid("value", format!("cannot read standard input: {e}")))?;
    if text.len() > cap {
        return Err(Error::new(
            ErrorKind::TooLarge,
            format!(
                "value on standard input is over {cap} bytes; the maximum value is {max_value_bytes} bytes of JSON"
            ),
        ));
    }
    Ok(text)
}

/// The password for `hash-password`: typed twice without echo on a terminal, else the first line
/// of standard input.
fn read_password() -> Result<String> {
    use std::io::IsTerminal;
    let unreadable = |e: std::io::Error| Error::invalid("password", format!("cannot read it: {e}"));
    if std::io::stdin().is_terminal() {
        let password = rpassword::prompt_password("Password: ").map_err(unreadable)?;
        if rpassword::prompt_password("Same password again: ").map_err(unreadable)? != password {
            return Err(Error::invalid("password", "the two entries differ"));
        }
        return Ok(password);
    }
    let text = read_stdin(64 * 1024)?;
    Ok(text.lines().next().unwrap_or_default().to_owned())
}

fn print_json(value: &Value) -> Result<()> {
    use std::io::Write;
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::new(ErrorKind::Internal, "cannot print result").with_source(e))?;
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{text}").and_then(|()| stdout.flush()) {
        // The reader went away (`| head`): not an error of ours.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.map_err(|e| Error::new(ErrorKind::Internal, "cannot write to standard output").with_source(e)),
    }
}

/// Reports an error on stderr and turns it into the exit status.
pub fn report(err: &Error) -> ExitCode {
    eprintln!("agentstore: {} error: {err}", err.kind());
    ExitCode::from(exit_code(err.kind()))
}
