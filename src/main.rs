//! The `agentstore` binary: parses the command line, loads settings, sets up logging, and runs.

use std::process::ExitCode;

use agentstore::cli::{self, Cli};
use agentstore::config::{LogFormat, Settings};
use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref(), &cli.overrides()) {
        Ok(settings) => settings,
        Err(err) => return cli::report(&err),
    };
    let default_level = if matches!(cli.command, cli::Command::Serve { .. }) { "info" } else { "warn" };
    init_logging(settings.log_format, default_level);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("agentstore: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli, settings)) {
        Ok(code) => ExitCode::from(code),
        Err(err) => cli::report(&err),
    }
}

/// Logs go to stderr so stdout carries only results. `RUST_LOG` sets the filter (default `info`
/// for `serve`, `warn` for the one-shot commands).
fn init_logging(format: LogFormat, default_level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // A failed log write (stderr closed) must not panic the server.
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).log_internal_errors(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
