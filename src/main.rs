//! The `agentstore` binary: parses the command line, loads settings, sets up logging, and runs.

use std::process::ExitCode;

use agentstore::cli::{self, Cli};
use agentstore::config::{LogFormat, Settings};
use clap::Parser;
use tracing_subscriber::EnvFilter;

/// The process's allocator (why: Cargo.toml, beside the dependency).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let serving = matches!(cli.command, cli::Command::Serve { .. });
    // Before the runtime starts any thread: arenas are created as threads first allocate.
    if !serving {
        limit_malloc_arenas();
    }
    let settings = match Settings::load(cli.config.as_deref(), &cli.overrides()) {
        Ok(settings) => settings,
        Err(err) => return cli::report(&err),
    };
    let default_level = if serving { "info" } else { "warn" };
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

/// glibc gives each thread that allocates an arena of its own (up to 8 per core), and memory freed
/// in one arena is not reused for another thread's allocations. In the bulk commands (`migrate`,
/// `verify`, `import`, `export`, ...), whose pipelines allocate and free batches and cache pages
/// across tokio's worker and blocking threads, that multiplies the heap: `migrate` of 1,000,000
/// documents between two embedded stores peaked at 362 MB with glibc's default and 209 MB with two
/// arenas, at the same speed. `serve` keeps the default: there the arenas spare its many
/// concurrent requests a shared allocator lock (two arenas cost about 20% of the CouchDB API's
/// create rate) and its peak stayed far lower. Measurements in docs/performance.md.
/// `MALLOC_ARENA_MAX` in the environment still decides when set.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only changes allocator settings; it runs first in main, before any other
        // thread exists. Its result (0 on failure) is ignored: the default arenas still work.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}

/// Logs go to stderr so stdout carries only results. `RUST_LOG` sets the filter (default `info`
/// for `serve`, `warn` for the one-shot commands).
fn init_logging(format: LogFormat, default_level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // A failed log write (stderr closed) must not panic the server. Colours only on a terminal:
    // in a container's log, a file or a pipe the escape codes are noise.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .log_internal_errors(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
