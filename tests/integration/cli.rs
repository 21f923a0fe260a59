//! The `agentstore` binary end to end: every test runs the real built binary in its own temporary
//! working directory, with the developer's `AGENTSTORE_*` environment removed, and checks its exit
//! status, its stderr and the JSON it prints.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use agentstore::backend::embedded::EmbeddedBackend;
use serde_json::{json, Value};
use tempfile::TempDir;

use crate::common::{agentstore as command, is_timestamp};

/// The default maximum value size, in bytes of compact JSON.
const DEFAULT_MAX: usize = 1_048_576;

/// The finished run of one command.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn from_output(what: &str, output: Output) -> Self {
        let run = Run {
            code: output.status.code(),
            stdout: String::from_utf8(output.stdout).expect("stdout is UTF-8"),
            stderr: String::from_utf8(output.stderr).expect("stderr is UTF-8"),
        };
        eprintln!("$ agentstore {what}\n  -> {:?}", run.code);
        run
    }

    /// Asserts a zero exit status and parses stdout as JSON.
    fn json(&self) -> Value {
        assert_eq!(self.code, Some(0), "expected success; stderr: {}; stdout: {}", self.stderr, self.stdout);
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.stdout))
    }

    /// Asserts the exit status and that nothing was printed on stdout.
    fn fails_with(&self, code: i32) -> &str {
        assert_eq!(
            self.code,
            Some(code),
            "expected exit status {code}; stderr: {}; stdout: {}",
            self.stderr,
            self.stdout
        );
        assert!(self.stdout.is_empty(), "a failure printed on stdout: {}", self.stdout);
        &self.stderr
    }
}

/// A temporary working directory with a store file in it.
struct Env {
    dir: TempDir,
    store: PathBuf,
}

impl Env {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = dir.path().join("store.redb");
        Env { dir, store }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn backend_url(&self) -> String {
        format!("embedded:{}", self.store.display())
    }

    /// `agentstore --backend embedded:<tmp>/store.redb ARGS…`
    fn cmd(&self, args: &[&str]) -> Command {
        let mut cmd = command(self.path());
        cmd.arg("--backend").arg(self.backend_url()).args(args);
        cmd
    }

    fn run(&self, args: &[&str]) -> Run {
        run_command(&args.join(" "), self.cmd(args))
    }

    /// Runs with `input` on standard input, which must be read to the end.
    fn run_stdin(&self, args: &[&str], input: &[u8]) -> Run {
        run_with_stdin(&args.join(" "), self.cmd(args), input)
    }
}

fn run_command(what: &str, mut cmd: Command) -> Run {
    let output = cmd.output().expect("run agentstore");
    Run::from_output(what, output)
}

/// Runs with `input` on standard input and fails unless the command read all of it.
fn run_with_stdin(what: &str, cmd: Command, input: &[u8]) -> Run {
    let (run, written) = run_feeding_stdin(what, cmd, input);
    written.unwrap_or_else(|e| panic!("agentstore did not read all of standard input ({e}); stderr: {}", run.stderr));
    run
}

/// Runs with `input` on standard input; also returns whether writing all of it succeeded.
fn run_feeding_stdin(what: &str, mut cmd: Command, input: &[u8]) -> (Run, std::io::Result<()>) {
    let mut child =
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn agentstore");
    let mut stdin = child.stdin.take().expect("stdin pipe");
    let input = input.to_vec();
    // Written from another thread so a large input cannot deadlock against a full stdout pipe.
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let output = child.wait_with_output().expect("wait for agentstore");
    let written = writer.join().expect("stdin writer thread");
    (Run::from_output(what, output), written)
}

fn timestamp(doc: &Value, field: &str) -> String {
    let text = doc[field].as_str().unwrap_or_else(|| panic!("{field} is not a string: {doc}"));
    assert!(is_timestamp(text), "{field} = {text:?} is not YYYY-MM-DDTHH:MM:SSZ");
    text.to_owned()
}

/// A JSON string value whose compact serialisation is exactly `bytes` bytes.
fn json_string_of_size(bytes: usize) -> String {
    format!("\"{}\"", "a".repeat(bytes - 2))
}

#[test]
fn timestamp_check_accepts_only_the_spec_form() {
    assert!(is_timestamp("2026-02-05T10:00:00Z"));
    for bad in [
        "2026-02-05T10:00:00",
        "2026-02-05T10:00:00.000Z",
        "2026-02-05 10:00:00Z",
        "2026-02-05T10:00:00+00:00",
        "2026-2-05T10:00:00ZZ",
        "x026-02-05T10:00:00Z",
    ] {
        assert!(!is_timestamp(bad), "{bad}");
    }
}

#[test]
fn help_of_the_command_and_every_subcommand() {
    let env = Env::new();
    let top = run_command("--help", {
        let mut cmd = command(env.path());
        cmd.arg("--help");
        cmd
    });
    assert_eq!(top.code, Some(0), "{}", top.stderr);
    for word in [
        "set",
        "get",
        "delete",
        "exists",
        "keys",
        "namespaces",
        "get-all",
        "delete-namespace",
        "purge-user",
        "--backend",
        "--config",
        "--max-value-bytes",
        "--log-format",
    ] {
        assert!(top.stdout.contains(word), "--help lacks {word}:\n{}", top.stdout);
    }

    let subcommands: [(&str, &[&str]); 9] = [
        ("set", &["<USER>", "<NAMESPACE>", "<KEY>", "<VALUE_JSON>", "--metadata", "--agent"]),
        ("get", &["<USER>", "<NAMESPACE>", "<KEY>", "--agent"]),
        ("delete", &["<USER>", "<NAMESPACE>", "<KEY>"]),
        ("exists", &["<USER>", "<NAMESPACE>", "<KEY>"]),
        ("keys", &["<USER>", "<NAMESPACE>"]),
        ("namespaces", &["<USER>"]),
        ("get-all", &["<USER>", "<NAMESPACE>"]),
        ("delete-namespace", &["<USER>", "<NAMESPACE>"]),
        ("purge-user", &["<USER>"]),
    ];
    for (name, arguments) in subcommands {
        let mut cmd = command(env.path());
        cmd.args([name, "--help"]);
        let help = run_command(&format!("{name} --help"), cmd);
        assert_eq!(help.code, Some(0), "{name} --help: {}", help.stderr);
        assert!(
            help.stdout.contains(&format!("agentstore {name}")),
            "{name} --help has no usage line:\n{}",
            help.stdout
        );
        for argument in arguments.iter().chain(&["--backend"]) {
            assert!(help.stdout.contains(argument), "{name} --help does not mention {argument}:\n{}", help.stdout);
        }
    }
    // Asking for help touches no store.
    assert!(!env.path().join("data").exists());
}

#[test]
fn the_whole_command_set_in_sequence() {
    let env = Env::new();

    // set: a new document.
    let created = env
        .run(&[
            "set",
            "user_123",
            "default",
            "greeting",
            r#""Hello, World!""#,
            "--metadata",
            r#"{"version": "1.0", "author": "alice"}"#,
            "--agent",
            "hello-agent",
        ])
        .json();
    assert_eq!(created["_id"], json!("user_123:default:Z3JlZXRpbmc="));
    assert!(created["_rev"].is_string(), "{created}");
    assert_eq!(created["userId"], json!("user_123"));
    assert_eq!(created["namespace"], json!("default"));
    assert_eq!(created["key"], json!("greeting"));
    assert_eq!(created["value"], json!("Hello, World!"));
    assert_eq!(created["metadata"], json!({"version": "1.0", "author": "alice"}));
    assert_eq!(created["createdByAgent"], json!("hello-agent"));
    assert_eq!(created["lastAccessedByAgent"], json!("hello-agent"));
    assert_eq!(created["accessCount"], json!(1));
    let created_at = timestamp(&created, "createdAt");
    assert_eq!(timestamp(&created, "updatedAt"), created_at);
    assert_eq!(timestamp(&created, "lastAccessedAt"), created_at);

    // set again: value replaced, metadata merged shallowly, creation fields kept.
    let updated = env
        .run(&[
            "set",
            "user_123",
            "default",
            "greeting",
            r#"{"text": "Hi"}"#,
            "--metadata",
            r#"{"version": "2.0", "reviewer": "bob"}"#,
            "--agent",
            "editor-agent",
        ])
        .json();
    assert_eq!(updated["_id"], created["_id"]);
    assert_ne!(updated["_rev"], created["_rev"]);
    assert_eq!(updated["value"], json!({"text": "Hi"}));
    assert_eq!(updated["metadata"], json!({"version": "2.0", "author": "alice", "reviewer": "bob"}));
    assert_eq!(updated["createdByAgent"], json!("hello-agent"));
    assert_eq!(updated["lastAccessedByAgent"], json!("editor-agent"));
    assert_eq!(updated["accessCount"], json!(2));
    assert_eq!(timestamp(&updated, "createdAt"), created_at);
    let updated_at = timestamp(&updated, "updatedAt");
    assert!(updated_at >= created_at);
    assert_eq!(timestamp(&updated, "lastAccessedAt"), updated_at);

    // set without metadata keeps the stored metadata.
    let no_metadata = env.run(&["set", "user_123", "default", "greeting", r#"{"text": "Hi"}"#]).json();
    assert_eq!(no_metadata["metadata"], updated["metadata"]);
    assert_eq!(no_metadata["lastAccessedByAgent"], json!("editor-agent"));
    assert_eq!(no_metadata["accessCount"], json!(3));
    let updated_at = timestamp(&no_metadata, "updatedAt");

    // get: counts an access, leaves updatedAt alone.
    let read = env.run(&["get", "user_123", "default", "greeting", "--agent", "reader"]).json();
    assert_eq!(read["_id"], json!("user_123:default:Z3JlZXRpbmc="));
    assert_eq!(read["userId"], json!("user_123"));
    assert_eq!(read["namespace"], json!("default"));
    assert_eq!(read["key"], json!("greeting"));
    assert_eq!(read["value"], json!({"text": "Hi"}));
    assert_eq!(read["metadata"], updated["metadata"]);
    assert_eq!(read["createdByAgent"], json!("hello-agent"));
    assert_eq!(read["lastAccessedByAgent"], json!("reader"));
    assert_eq!(read["accessCount"], json!(4));
    assert_eq!(timestamp(&read, "createdAt"), created_at);
    assert_eq!(timestamp(&read, "updatedAt"), updated_at);
    assert!(timestamp(&read, "lastAccessedAt") >= updated_at);

    // More documents: another key, another namespace, another user.
    env.run(&["set", "user_123", "default", "other-key", "42"]).json();
    env.run(&["set", "user_123", "files:my-repo", "src/main.py", r#"{"lines": 10}"#]).json();
    env.run(&["set", "user_456", "default", "greeting", r#""hey""#]).json();

    // keys
    assert_eq!(env.run(&["keys", "user_123", "default"]).json(), json!(["greeting", "other-key"]));
    assert_eq!(env.run(&["keys", "user_123", "files:my-repo"]).json(), json!(["src/main.py"]));
    assert_eq!(env.run(&["keys", "user_123", "empty"]).json(), json!([]));

    // namespaces
    assert_eq!(env.run(&["namespaces", "user_123"]).json(), json!(["default", "files:my-repo"]));
    assert_eq!(env.run(&["namespaces", "user_456"]).json(), json!(["default"]));

    // get-all: values by key, not counted as an access.
    assert_eq!(
        env.run(&["get-all", "user_123", "default"]).json(),
        json!({"greeting": {"text": "Hi"}, "other-key": 42})
    );
    assert_eq!(env.run(&["get-all", "user_123", "files:my-repo"]).json(), json!({"src/main.py": {"lines": 10}}));
    assert_eq!(env.run(&["get-all", "nobody", "default"]).json(), json!({}));
    let reread = env.run(&["get", "user_123", "default", "greeting"]).json();
    assert_eq!(reread["accessCount"], json!(5));
    // A read without an agent keeps the last agent.
    assert_eq!(reread["lastAccessedByAgent"], json!("reader"));

    // delete, then exists
    assert_eq!(env.run(&["exists", "user_123", "default", "other-key"]).json(), json!(true));
    assert_eq!(env.run(&["delete", "user_123", "default", "other-key"]).json(), json!({"deleted": true}));
    let stderr = env.run(&["delete", "user_123", "default", "other-key"]).fails_with(3).to_owned();
    assert!(stderr.contains("other-key"), "{stderr}");
    assert_eq!(env.run(&["exists", "user_123", "default", "other-key"]).json(), json!(false));
    assert_eq!(env.run(&["exists", "user_123", "default", "greeting"]).json(), json!(true));
    // exists is not an access.
    assert_eq!(env.run(&["get", "user_123", "default", "greeting"]).json()["accessCount"], json!(6));

    // delete-namespace
    assert_eq!(env.run(&["delete-namespace", "user_123", "default"]).json(), json!({"deleted": 1}));
    assert_eq!(env.run(&["keys", "user_123", "default"]).json(), json!([]));
    assert_eq!(env.run(&["namespaces", "user_123"]).json(), json!(["files:my-repo"]));
    assert_eq!(
        env.run(&["exists", "user_456", "default", "greeting"]).json(),
        json!(true),
        "another user's namespace of the same name was touched"
    );

    // purge-user
    env.run(&["set", "user_123", "scratch", "a", "1"]).json();
    assert_eq!(env.run(&["purge-user", "user_123"]).json(), json!({"deleted": 2}));
    assert_eq!(env.run(&["namespaces", "user_123"]).json(), json!([]));
    assert_eq!(env.run(&["purge-user", "user_123"]).json(), json!({"deleted": 0}));
    assert_eq!(env.run(&["namespaces", "user_456"]).json(), json!(["default"]), "purging one user touched another");
    assert_eq!(env.run(&["get", "user_456", "default", "greeting"]).json()["value"], json!("hey"));
}

#[test]
fn default_backend_is_relative_to_the_working_directory() {
    let env = Env::new();
    let default_file = env.path().join("data").join("agentstore.redb");
    assert!(!default_file.exists());

    let mut cmd = command(env.path());
    cmd.args(["set", "u", "ns", "k", r#""stored by default""#]);
    let set = run_command("set (no --backend)", cmd);
    assert_eq!(set.json()["value"], json!("stored by default"));
    assert!(default_file.is_file(), "{} was not created", default_file.display());
    assert!(!env.store.exists());

    // The document is in that file: read it by naming the file explicitly.
    let mut cmd = command(env.path());
    cmd.arg("--backend").arg(format!("embedded:{}", default_file.display())).args(["get", "u", "ns", "k"]);
    let got = run_command("get (explicit default file)", cmd);
    assert_eq!(got.json()["value"], json!("stored by default"));
}

#[test]
fn numbers_round_trip_with_their_digits() {
    let env = Env::new();
    let value = r#"{"big": 123456789012345678901234567890123456789, "u": 18446744073709551615, "f": 1e-07}"#;
    let literals = ["123456789012345678901234567890123456789", "18446744073709551615", "1e-07"];
    let set = env.run(&["set", "u", "ns", "numbers", value]);
    set.json();
    for run in [&set, &env.run(&["get", "u", "ns", "numbers"]), &env.run(&["get-all", "u", "ns"])] {
        assert_eq!(run.code, Some(0), "{}", run.stderr);
        for literal in literals {
            assert!(run.stdout.contains(literal), "{literal} did not come back:\n{}", run.stdout);
        }
    }
    // The same through standard input.
    let piped = env.run_stdin(&["set", "u", "ns", "piped", "-"], value.as_bytes());
    piped.json();
    let got = env.run(&["get", "u", "ns", "piped"]);
    for literal in literals {
        assert!(got.stdout.contains(literal), "{literal}:\n{}", got.stdout);
    }
}

#[test]
fn stdin_value_of_exactly_the_maximum_size_is_accepted() {
    let env = Env::new();
    let value = json_string_of_size(DEFAULT_MAX);
    assert_eq!(value.len(), DEFAULT_MAX);
    let set = env.run_stdin(&["set", "u", "ns", "big", "-"], value.as_bytes());
    let expected = Value::String("a".repeat(DEFAULT_MAX - 2));
    assert_eq!(set.json()["value"], expected);
    assert_eq!(env.run(&["get", "u", "ns", "big"]).json()["value"], expected);
}

#[test]
fn stdin_value_one_byte_over_the_maximum_is_refused() {
    let env = Env::new();
    let value = json_string_of_size(DEFAULT_MAX + 1);
    let run = env.run_stdin(&["set", "u", "ns", "big", "-"], value.as_bytes());
    let stderr = run.fails_with(2);
    assert!(stderr.contains("1048576"), "{stderr}");
    assert!(stderr.contains("1048577"), "{stderr}");
    assert_eq!(env.run(&["exists", "u", "ns", "big"]).json(), json!(false));
}

#[test]
fn stdin_value_far_over_the_maximum_is_refused() {
    // With a 10-byte limit, standard input is read up to 4 × 10 + 64 KiB = 65,576 bytes; past
    // that the value is refused unparsed (and the rest of the input may go unread).
    let env = Env::new();
    let args = ["--max-value-bytes", "10", "set", "u", "ns", "k", "-"];
    let (run, _unread_input_is_fine) =
        run_feeding_stdin("set - (far too big)", env.cmd(&args), json_string_of_size(200_000).as_bytes());
    let stderr = run.fails_with(2);
    assert!(stderr.contains("65576"), "{stderr}");
    assert!(stderr.contains("10 bytes"), "{stderr}");
    // Under the cap but over the limit: parsed, then refused by its compact size.
    let run = env.run_stdin(&args, json_string_of_size(1000).as_bytes());
    let stderr = run.fails_with(2);
    assert!(stderr.contains("1000 bytes"), "{stderr}");
    assert_eq!(env.run(&["exists", "u", "ns", "k"]).json(), json!(false));
}

#[test]
fn max_value_bytes_flag_lowers_the_limit() {
    let env = Env::new();
    let limit = ["--max-value-bytes", "100"];
    let at_limit = json_string_of_size(100);
    let over = json_string_of_size(101);

    let args = [&limit[..], &["set", "u", "ns", "k", "-"]].concat();
    env.run_stdin(&args, at_limit.as_bytes()).json();
    let stderr = env.run_stdin(&args, over.as_bytes()).fails_with(2).to_owned();
    assert!(stderr.contains("100 bytes"), "{stderr}");

    // The same limit applies to a value given as an argument.
    let args = [&limit[..], &["set", "u", "ns", "k2", &over]].concat();
    env.run(&args).fails_with(2);
    let args = [&limit[..], &["set", "u", "ns", "k2", &at_limit]].concat();
    env.run(&args).json();
}

#[test]
fn max_value_bytes_from_the_environment() {
    let env = Env::new();
    let at_limit = json_string_of_size(100);
    let over = json_string_of_size(101);
    let run = |input: &str, extra: &[&str]| {
        let args = [extra, &["set", "u", "ns", "k", "-"]].concat();
        let mut cmd = env.cmd(&args);
        cmd.env("AGENTSTORE_MAX_VALUE_BYTES", "100");
        run_with_stdin("set - (AGENTSTORE_MAX_VALUE_BYTES=100)", cmd, input.as_bytes())
    };
    run(&at_limit, &[]).json();
    let over_run = run(&over, &[]);
    let stderr = over_run.fails_with(2);
    assert!(stderr.contains("100 bytes"), "{stderr}");
    // The flag overrides the environment.
    run(&over, &["--max-value-bytes", "101"]).json();
}

#[test]
fn exit_statuses() {
    let env = Env::new();

    let stderr = env.run(&["set", "a:b", "ns", "k", "1"]).fails_with(2).to_owned();
    assert!(stderr.contains("user_id"), "{stderr}");
    let stderr = env.run(&["get", "a:b", "ns", "k"]).fails_with(2).to_owned();
    assert!(stderr.contains("user_id"), "{stderr}");

    let stderr = env.run(&["set", "u", "ns", "k", "{not json"]).fails_with(2).to_owned();
    assert!(stderr.contains("value"), "{stderr}");

    for metadata in ["[1, 2]", r#""text""#, "3", "null"] {
        let stderr = env.run(&["set", "u", "ns", "k", "1", "--metadata", metadata]).fails_with(2).to_owned();
        assert!(stderr.contains("metadata"), "{metadata}: {stderr}");
    }
    let stderr = env.run(&["set", "u", "ns", "k", "1", "--metadata", "{oops"]).fails_with(2).to_owned();
    assert!(stderr.contains("metadata"), "{stderr}");
    // None of the refused writes stored anything.
    assert_eq!(env.run(&["exists", "u", "ns", "k"]).json(), json!(false));

    let stderr = env.run(&["get", "u", "ns", "missing"]).fails_with(3).to_owned();
    assert!(stderr.contains("missing"), "{stderr}");

    let mut cmd = command(env.path());
    cmd.args(["--backend", "nosuch://somewhere", "keys", "u", "ns"]);
    let stderr = run_command("--backend nosuch://", cmd).fails_with(2).to_owned();
    assert!(stderr.contains("nosuch"), "{stderr}");
    assert!(stderr.contains("backend"), "{stderr}");

    // A usage error is clap's: status 2 too.
    let usage = env.run(&["set", "u", "ns"]);
    assert_eq!(usage.code, Some(2), "{}", usage.stderr);
}

#[test]
fn config_file_named_on_the_command_line() {
    let env = Env::new();
    let configured = env.path().join("from-config").join("store.redb");
    let config = env.path().join("custom.toml");
    std::fs::write(&config, format!("backend = \"embedded:{}\"\nmax_value_bytes = 50\n", configured.display()))
        .unwrap();

    let mut cmd = command(env.path());
    cmd.arg("--config").arg(&config).args(["set", "u", "ns", "k", r#""configured""#]);
    run_command("--config custom.toml set", cmd).json();
    assert!(configured.is_file(), "the configured backend was not used");
    assert!(!env.path().join("data").exists(), "the default was used");

    // The file's limit applies.
    let mut cmd = command(env.path());
    cmd.arg("--config").arg(&config).args(["set", "u", "ns", "k2", &json_string_of_size(51)]);
    run_command("--config custom.toml set (too big)", cmd).fails_with(2);

    // A flag overrides the file.
    let mut cmd = command(env.path());
    cmd.arg("--config").arg(&config).args(["--backend", &env.backend_url(), "set", "u", "ns", "k", "1"]);
    run_command("--config custom.toml --backend … set", cmd).json();
    assert!(env.store.is_file());

    // The environment overrides the file.
    let from_env = env.path().join("from-env.redb");
    let mut cmd = command(env.path());
    cmd.arg("--config")
        .arg(&config)
        .env("AGENTSTORE_BACKEND", format!("embedded:{}", from_env.display()))
        .args(["set", "u", "ns", "k", "1"]);
    run_command("AGENTSTORE_BACKEND=… --config custom.toml set", cmd).json();
    assert!(from_env.is_file());
}

#[test]
fn missing_config_file_is_a_clear_error() {
    let env = Env::new();
    let mut cmd = command(env.path());
    cmd.args(["--config", "no-such-config.toml", "keys", "u", "ns"]);
    let run = run_command("--config no-such-config.toml keys", cmd);
    assert_ne!(run.code, Some(0));
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert!(run.stderr.contains("no-such-config.toml"), "stderr does not name the file: {}", run.stderr);
    assert!(!env.path().join("data").exists(), "a store was opened anyway");
}

/// `hash-password` prints a PHC string that, configured as a CouchDB API login, accepts exactly
/// that password; an empty one is refused.
#[tokio::test]
async fn hash_password_prints_a_hash_the_couchdb_api_accepts() {
    use agentstore::couchdb_api::auth::{CouchAuth, Principal};
    use base64::Engine;

    let env = Env::new();
    let mut cmd = command(env.path());
    cmd.arg("hash-password");
    let run = run_with_stdin("hash-password", cmd, b"correct horse:battery\n");
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let phc = run.stdout.trim_end();
    assert!(phc.starts_with("$argon2id$") && !phc.contains('\n'), "{phc}");

    let config = env.path().join("couch.toml");
    std::fs::write(&config, format!("[[couchdb_users]]\nname = \"root\"\npassword_hash = \"{phc}\"\nadmin = true\n"))
        .unwrap();
    let settings = agentstore::config::Settings::load(Some(&config), &Default::default()).expect("settings");
    let auth = CouchAuth::from_settings(&settings).expect("couchdb_users");
    let basic = |credentials: &str| {
        let mut headers = axum::http::HeaderMap::new();
        let value = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(credentials));
        headers.insert(axum::http::header::AUTHORIZATION, value.parse().unwrap());
        headers
    };
    assert_eq!(auth.authenticate(&basic("root:correct horse:battery")).await.unwrap(), Some(Principal::Admin));
    assert!(auth.authenticate(&basic("root:correct horse:battery\n")).await.is_err());

    let mut cmd = command(env.path());
    cmd.arg("hash-password");
    let empty = run_with_stdin("hash-password (empty)", cmd, b"\n");
    assert!(empty.fails_with(2).contains("password"), "{}", empty.stderr);
}

#[test]
fn agentstore_toml_in_the_working_directory_is_read() {
    let env = Env::new();
    std::fs::write(
        env.path().join("agentstore.toml"),
        "backend = \"embedded:./from-toml/s.redb\"\nmax_value_bytes = 20\n",
    )
    .unwrap();

    let mut cmd = command(env.path());
    cmd.args(["set", "u", "ns", "k", r#""from toml""#]);
    run_command("set (agentstore.toml present)", cmd).json();
    assert!(env.path().join("from-toml").join("s.redb").is_file());
    assert!(!env.path().join("data").exists(), "the default was used");

    let mut cmd = command(env.path());
    cmd.args(["set", "u", "ns", "k", &json_string_of_size(21)]);
    let stderr = run_command("set (over the toml limit)", cmd).fails_with(2).to_owned();
    assert!(stderr.contains("20 bytes"), "{stderr}");

    let mut cmd = command(env.path());
    cmd.args(["get", "u", "ns", "k"]);
    assert_eq!(run_command("get (agentstore.toml present)", cmd).json()["value"], json!("from toml"));
}

/// Waits for `child` at most `limit`; kills it and fails the test when it takes longer.
async fn wait_or_kill(mut child: std::process::Child, limit: Duration) -> Run {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("poll agentstore").is_some() {
            let output = child.wait_with_output().expect("collect agentstore output");
            return Run::from_output("(against a held store)", output);
        }
        if Instant::now() >= deadline {
            child.kill().ok();
            let output = child.wait_with_output().ok();
            panic!(
                "agentstore still running after {limit:?} against a held store; stderr: {:?}",
                output.map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_process_is_refused_at_once() {
    let env = Env::new();
    let held = EmbeddedBackend::open(&env.store).await.expect("open the store in the test process");

    let child = env
        .cmd(&["set", "u", "ns", "k", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn agentstore");
    let run = wait_or_kill(child, Duration::from_secs(10)).await;
    let stderr = run.fails_with(5);
    assert!(stderr.contains("already open"), "{stderr}");
    assert!(stderr.contains("store.redb"), "{stderr}");

    // Once the holder lets go, the same command works.
    drop(held);
    let child = env
        .cmd(&["set", "u", "ns", "k", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn agentstore");
    let run = wait_or_kill(child, Duration::from_secs(10)).await;
    assert_eq!(run.json()["value"], json!(1));
}

#[test]
fn settings_from_the_environment_reach_the_store() {
    let env = Env::new();
    let with = |vars: &[(&str, &str)], args: &[&str]| {
        let mut cmd = env.cmd(args);
        for (name, value) in vars {
            cmd.env(name, value);
        }
        run_command(&format!("{vars:?} {}", args.join(" ")), cmd)
    };

    // track_reads = false: get is read-only.
    env.run(&["set", "u", "ns", "k", "1"]).json();
    for _ in 0..2 {
        let got = with(&[("AGENTSTORE_TRACK_READS", "false")], &["get", "u", "ns", "k", "--agent", "r"]).json();
        assert_eq!(got["accessCount"], json!(1));
        assert!(got.get("lastAccessedByAgent").is_none(), "{got}");
    }
    assert_eq!(env.run(&["get", "u", "ns", "k"]).json()["accessCount"], json!(2));

    // page_size = 1: listings and deletes still follow every page.
    let paged = [("AGENTSTORE_PAGE_SIZE", "1")];
    for key in ["k2", "k3"] {
        with(&paged, &["set", "u", "ns", key, "2"]).json();
    }
    with(&paged, &["set", "u", "other", "k", "3"]).json();
    assert_eq!(with(&paged, &["keys", "u", "ns"]).json(), json!(["k", "k2", "k3"]));
    assert_eq!(with(&paged, &["namespaces", "u"]).json(), json!(["ns", "other"]));
    assert_eq!(with(&paged, &["get-all", "u", "ns"]).json(), json!({"k": 1, "k2": 2, "k3": 2}));
    assert_eq!(with(&paged, &["delete-namespace", "u", "ns"]).json(), json!({"deleted": 3}));
    assert_eq!(with(&paged, &["purge-user", "u"]).json(), json!({"deleted": 1}));
    assert_eq!(env.run(&["namespaces", "u"]).json(), json!([]));

    // Bad settings are configuration errors.
    let stderr = with(&[("AGENTSTORE_PAGE_SIZE", "0")], &["keys", "u", "ns"]).fails_with(2).to_owned();
    assert!(stderr.contains("page_size"), "{stderr}");
    let stderr = with(&[("AGENTSTORE_LOG_FORMAT", "fancy")], &["keys", "u", "ns"]).fails_with(2).to_owned();
    assert!(stderr.contains("log_format"), "{stderr}");
}

#[test]
fn metadata_has_the_value_size_limit() {
    let env = Env::new();
    let metadata = format!(r#"{{"note":{}}}"#, json_string_of_size(92));
    assert_eq!(metadata.len(), 101);
    let stderr = env
        .run(&["--max-value-bytes", "100", "set", "u", "ns", "k", "1", "--metadata", &metadata])
        .fails_with(2)
        .to_owned();
    assert!(stderr.contains("metadata"), "{stderr}");
    assert!(stderr.contains("100 bytes"), "{stderr}");
    let metadata = format!(r#"{{"note":{}}}"#, json_string_of_size(91));
    env.run(&["--max-value-bytes", "100", "set", "u", "ns", "k", "1", "--metadata", &metadata]).json();
}

#[test]
fn invalid_names_are_refused_before_a_store_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let output = command(dir.path()).args(["set", "a:b", "ns", "k", "1"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("user_id"));
    assert!(!dir.path().join("data").exists(), "no store file for a refused command");
}

#[test]
fn config_file_without_toml_extension_is_read_as_toml() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("from-conf.redb");
    std::fs::write(dir.path().join("conf"), format!("backend = \"embedded:{}\"\n", store.display())).unwrap();
    let output = command(dir.path()).args(["--config", "conf", "set", "u", "ns", "k", "1"]).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(store.exists());
}

#[test]
fn a_closed_stdout_is_not_a_crash() {
    use std::io::Read;
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let backend = format!("embedded:{}", dir.path().join("s.redb").display());
    let big = format!("\"{}\"", "x".repeat(100_000));
    let set = command(dir.path()).args(["--backend", &backend, "set", "u", "ns", "k", &big]).output().unwrap();
    assert!(set.status.success());
    let mut child = command(dir.path())
        .args(["--backend", &backend, "get", "u", "ns", "k"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read a little, then close the pipe, as `| head -c 10` does.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 10];
    stdout.read_exact(&mut first).unwrap();
    drop(stdout);
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(0), "{stderr}");
}

// ---- the change feed and upgrade ----

/// The lines of an NDJSON output, parsed.
fn ndjson(run: &Run) -> Vec<Value> {
    assert_eq!(run.code, Some(0), "expected success; stderr: {}", run.stderr);
    run.stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}")))
        .collect()
}

/// Splits `changes` output into `(id, rev, deleted)` per change and the final `last_seq`,
/// checking every line's shape.
fn change_lines(run: &Run) -> (Vec<(String, String, bool)>, Vec<String>, String) {
    let mut lines = ndjson(run);
    let last = lines.pop().expect("at least the position line");
    let fields: Vec<&String> = last.as_object().expect("an object").keys().collect();
    assert_eq!(fields, ["last_seq"], "{last}");
    let mut seqs = Vec::new();
    let rows = lines
        .iter()
        .map(|line| {
            let fields: Vec<&String> = line.as_object().expect("an object").keys().collect();
            assert_eq!(fields, ["seq", "id", "rev", "deleted"], "{line}");
            seqs.push(line["seq"].as_str().expect("seq").to_owned());
            let text = |field: &str| line[field].as_str().unwrap_or_else(|| panic!("{field}: {line}")).to_owned();
            (text("id"), text("rev"), line["deleted"].as_bool().expect("deleted"))
        })
        .collect();
    (rows, seqs, last["last_seq"].as_str().expect("last_seq").to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_prints_the_feed_as_ndjson() {
    use agentstore::backend::DocumentBackend;
    let env = Env::new();
    let text = |doc: &Value, field: &str| doc[field].as_str().expect("text").to_owned();
    env.run(&["set", "u", "ns", "a", "1"]).json();
    let b = env.run(&["set", "u", "ns", "b", "1"]).json();
    let c = env.run(&["set", "u", "ns", "c", "1"]).json();
    env.run(&["delete", "u", "ns", "b"]).json();
    let a = env.run(&["set", "u", "ns", "a", "2"]).json();
    let tombstone = {
        let store = EmbeddedBackend::open(&env.store).await.expect("open the store");
        store.revisions(&text(&b, "_id")).await.expect("revisions").expect("b's tombstone").rev.0
    };
    // Each document once, at its last write, in the order of those last writes.
    let expected = vec![
        (text(&c, "_id"), text(&c, "_rev"), false),
        (text(&b, "_id"), tombstone, true),
        (text(&a, "_id"), text(&a, "_rev"), false),
    ];

    let (rows, seqs, last_seq) = change_lines(&env.run(&["changes"]));
    assert_eq!(rows, expected);
    assert_eq!(last_seq, seqs[2]);

    // --limit bounds the changes printed; the position line continues after the last one.
    let (rows, _, after_two) = change_lines(&env.run(&["changes", "--limit", "2"]));
    assert_eq!(rows, expected[..2]);
    assert_eq!(after_two, seqs[1]);
    let (rows, _, end) = change_lines(&env.run(&["changes", "--since", &after_two]));
    assert_eq!((rows.as_slice(), end.as_str()), (&expected[2..], last_seq.as_str()));
    let (rows, _, end) = change_lines(&env.run(&["changes", "--since", &last_seq]));
    assert_eq!((rows, end), (vec![], last_seq.clone()));
    let (rows, _, _) = change_lines(&env.run(&["changes", "--since", "now"]));
    assert_eq!(rows, []);

    let stderr = env.run(&["changes", "--since", "not-a-position"]).fails_with(2).to_owned();
    assert!(stderr.contains("since"), "{stderr}");
    let usage = env.run(&["changes", "--limit", "0"]);
    assert_eq!(usage.code, Some(2), "{}", usage.stderr);
    let mut missing = command(env.path());
    missing.args(["--backend", "embedded:nothing-here.redb", "changes"]);
    let stderr = run_command("changes on a missing file", missing).fails_with(2).to_owned();
    assert!(stderr.contains("does not exist"), "{stderr}");
    assert!(!env.path().join("nothing-here.redb").exists(), "a missing store was created");
}

#[test]
fn changes_follow_waits_until_interrupted_then_prints_the_position() {
    use std::io::{BufRead, BufReader};
    let env = Env::new();
    env.run(&["set", "u", "ns", "a", "1"]).json();
    env.run(&["set", "u", "ns", "b", "1"]).json();
    let mut child =
        env.cmd(&["changes", "--follow"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut seqs = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        stdout.read_line(&mut line).expect("a change line");
        let change: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        seqs.push(change["seq"].as_str().expect("seq").to_owned());
    }
    // At the end of the feed it keeps waiting.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(child.try_wait().expect("poll"), None, "--follow exited at the end of the feed");
    let interrupted = Command::new("kill").args(["-INT", &child.id().to_string()]).status().expect("kill");
    assert!(interrupted.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().expect("poll").is_none() {
        assert!(Instant::now() < deadline, "still running 10 s after SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).expect("rest of stdout");
    let status = child.wait().expect("status");
    assert_eq!(status.code(), Some(0), "exit status {status}");
    let last: Value = serde_json::from_str(rest.trim()).unwrap_or_else(|e| panic!("{e}: {rest:?}"));
    assert_eq!(last, json!({ "last_seq": seqs[1] }));
}

/// `n` documents of user `u`, as the previous release stored them.
fn previous_release_documents(n: usize) -> Vec<(String, serde_json::Map<String, Value>)> {
    (0..n)
        .map(|i| {
            let key = format!("k{i:05}");
            let id = format!("u:ns:{}", agentstore::model::id::encode_key(&key));
            let body = json!({ "userId": "u", "namespace": "ns", "key": key, "value": i });
            (id, body.as_object().expect("object").clone())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_killed_part_way_resumes_and_finishes() {
    use agentstore::backend::{DocumentBackend, LayoutState};
    let env = Env::new();
    // More than two of `changes`' pages of 1,000.
    let documents = previous_release_documents(2_100);
    agentstore::backend::embedded::write_previous_release_file(&env.store, &documents).expect("old store");

    // Features that need the new layout say what to run; the old store is otherwise untouched.
    let stderr = env.run(&["changes"]).fails_with(5).to_owned();
    assert!(stderr.contains("agentstore upgrade"), "{stderr}");

    let stderr = env.run(&["upgrade", "--batch", "0"]).fails_with(2).to_owned();
    assert!(stderr.contains("batch"), "{stderr}");

    // A slowed run, killed once its checkpoint shows some pages done.
    let checkpoint = env.path().join("upgrade.json");
    let checkpoint_arg = checkpoint.display().to_string();
    let args = ["upgrade", "--checkpoint", checkpoint_arg.as_str(), "--batch", "10", "--progress", "log"];
    let mut slow = env.cmd(&args);
    slow.env("AGENTSTORE_UPGRADE_PAGE_DELAY_MS", "100").stdout(Stdio::null()).stderr(Stdio::null());
    let mut child = slow.spawn().expect("spawn upgrade");
    let deadline = Instant::now() + Duration::from_secs(30);
    let examined = loop {
        let saved: Option<Value> =
            std::fs::read_to_string(&checkpoint).ok().and_then(|text| serde_json::from_str(&text).ok());
        if let Some(examined) = saved.and_then(|s| s["examined"].as_u64()).filter(|n| *n >= 30) {
            break examined;
        }
        assert!(child.try_wait().expect("poll").is_none(), "upgrade ended before it could be killed");
        assert!(Instant::now() < deadline, "no progress in the checkpoint after 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    assert!(examined < 2_100, "killed after the last page");
    {
        let store = EmbeddedBackend::open(&env.store).await.expect("open");
        assert!(matches!(store.layout().await.expect("layout"), LayoutState::NeedsUpgrade(_)));
    }

    // The rerun resumes from the checkpoint and finishes.
    let report = env.run(&args).json();
    assert_eq!(report["status"], json!("upgraded"), "{report}");
    assert_eq!((report["resumed"].clone(), report["runs"].clone()), (json!(true), json!(2)), "{report}");
    assert!(report["examined"].as_u64().expect("examined") >= 2_100, "{report}");
    assert!(!checkpoint.exists(), "the checkpoint outlived the finished upgrade");

    {
        let store = EmbeddedBackend::open(&env.store).await.expect("open");
        assert_eq!(store.layout().await.expect("layout"), LayoutState::Current);
        let page = store.changes(None, 10_000).await.expect("changes");
        let mut fed: Vec<&str> = page.changes.iter().map(|c| c.id.as_str()).collect();
        fed.sort_unstable();
        let mut ids: Vec<&str> = documents.iter().map(|(id, _)| id.as_str()).collect();
        ids.sort_unstable();
        assert_eq!(fed, ids, "every document in the feed exactly once");
        for (id, body) in &documents {
            let stored = store.get(id).await.expect("get").unwrap_or_else(|| panic!("{id} lost"));
            assert_eq!(&stored.body["value"], &body["value"], "{id}");
        }
    }

    // `changes` pages through the whole feed: every document once.
    let (rows, _, _) = change_lines(&env.run(&["changes"]));
    let mut printed: Vec<&str> = rows.iter().map(|(id, _, _)| id.as_str()).collect();
    printed.sort_unstable();
    let mut ids: Vec<&str> = documents.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(printed, ids);

    // Idempotent: a further run finds nothing to do.
    let again = env.run(&args).json();
    assert_eq!(again["status"], json!("already_current"), "{again}");
}
