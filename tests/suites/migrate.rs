//! Migration end to end: `migrate` then `verify` between every ordered pair of the selected
//! backends (the contract suite's harness, so a backend added there is covered here too), the
//! options (conflict policies, filters, dry run, access tracking, export/import), crash safety
//! (the real binary killed with SIGKILL at random moments and resumed), and bad input.
//!
//! `AGENTSTORE_TEST_BACKENDS` selects backends as for the contract suite.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::backend::embedded::EmbeddedBackend;
use agentstore::backend::raw::layer::Layered;
use agentstore::backend::{BulkWrite, DocumentBackend, Precondition};
use agentstore::migrate::sink::ConflictPolicy;
use agentstore::migrate::transform::AccessTracking;
use agentstore::migrate::verify::{verify, VerifyOptions};
use agentstore::migrate::{self, Endpoint, Filter, Job, JobKind, Options};
use agentstore::model::id::encode_key;
use agentstore::ErrorKind;
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{json, Map, Value};

use crate::common::harness::{self, BackendHarness, Ctx};
use crate::common::json::{exact_eq, first_difference, survives_f64};
use crate::common::{agentstore, block_on, check, object, TestResult};

const USERS: [&str; 3] = ["alice", "bob", "carol_3"];
const NAMESPACES: [&str; 3] = ["default", "files:my-repo", "cache:github"];
const KEYS_PER_NAMESPACE: usize = 20;

/// What the harness gives for a fresh, empty backend.
type FreshFn = fn() -> harness::BoxFuture<Result<Ctx, String>>;
/// A test run on one backend.
type SingleTest = fn(FreshFn) -> TestResult;

/// The suite's trials, named `migrate::…`; `None`, after printing why, when the backend
/// selection is invalid.
pub fn trials(args: &Arguments) -> Option<Vec<Trial>> {
    let (backends, selected) = harness::announce("migrate suite", args.list)?;
    let is_selected = |name: &str| selected.contains(&name);
    let mut trials = Vec::new();
    for source in &backends {
        for target in &backends {
            if source.name == target.name && source.name != "embedded" {
                continue;
            }
            let (fresh_source, fresh_target) = (source.fresh, target.fresh);
            let run_it = is_selected(source.name) && is_selected(target.name);
            trials.push(
                Trial::test(format!("migrate::pair::{}_to_{}", source.name, target.name), move || {
                    block_on(pair_round_trip(fresh_source, fresh_target))
                })
                .with_ignored_flag(!run_it),
            );
        }
    }
    let embedded = find(&backends, "embedded").fresh;
    let singles: Vec<(&str, SingleTest)> = vec![
        ("conflict_policies", |fresh| block_on(conflict_policies(fresh))),
        ("filters", |fresh| block_on(filters(fresh))),
        ("dry_run_writes_nothing", |fresh| block_on(dry_run_writes_nothing(fresh))),
        ("access_tracking_reset", |fresh| block_on(access_tracking_reset(fresh))),
        ("changed_parameters_are_refused", |fresh| block_on(changed_parameters_are_refused(fresh))),
        ("export_import_round_trip", |fresh| block_on(export_import_round_trip(fresh))),
        ("export_resume_truncates_to_the_checkpoint", |fresh| block_on(export_resume_truncates(fresh))),
        ("import_reports_unreadable_lines", |fresh| block_on(import_reports_unreadable_lines(fresh))),
        ("read_back_catches_a_target_that_alters_documents", |fresh| block_on(read_back_catches_alterations(fresh))),
        ("verify_keeps_a_progress_record_in_its_target", |fresh| block_on(verify_keeps_a_record(fresh))),
    ];
    for (name, run) in singles {
        trials.push(
            Trial::test(format!("migrate::embedded::{name}"), move || run(embedded))
                .with_ignored_flag(!is_selected("embedded")),
        );
    }
    trials.push(
        Trial::test("migrate::couchdb::design_documents_stay_behind", || {
            block_on(couchdb_design_documents_stay_behind())
        })
        .with_ignored_flag(!is_selected("couchdb")),
    );
    let couchdb = find(&backends, "couchdb").fresh;
    trials.push(
        Trial::test("migrate::couchdb::numbers_it_would_alter_are_refused_not_written", move || {
            block_on(couchdb_numbers_are_refused(embedded, couchdb))
        })
        .with_ignored_flag(!(is_selected("embedded") && is_selected("couchdb"))),
    );
    trials.push(
        Trial::test("migrate::crash::embedded_to_embedded", || crash_and_resume(CrashTarget::Embedded))
            .with_ignored_flag(!is_selected("embedded")),
    );
    trials.push(
        Trial::test("migrate::crash::embedded_to_dynamodb", || crash_and_resume(CrashTarget::DynamoDb))
            .with_ignored_flag(!(is_selected("embedded") && is_selected("dynamodb"))),
    );
    trials.push(
        Trial::test("migrate::crash::embedded_to_firestore", || crash_and_resume(CrashTarget::Firestore))
            .with_ignored_flag(!(is_selected("embedded") && is_selected("firestore"))),
    );
    trials.push(Trial::test("migrate::cli::migrate_reads_back_unless_no_verify", migrate_reads_back_unless_no_verify));
    trials.push(Trial::test("migrate::bad_input::unreachable_source", bad_input_unreachable_source));
    trials.push(Trial::test("migrate::bad_input::unreachable_target", bad_input_unreachable_target));
    trials.push(Trial::test("migrate::bad_input::missing_embedded_source", bad_input_missing_embedded_source));
    trials.push(
        Trial::test("migrate::bad_input::couchdb_wrong_credentials_and_missing_database", bad_input_couchdb)
            .with_ignored_flag(!is_selected("couchdb")),
    );
    trials.push(
        Trial::test("migrate::bad_input::dynamodb_missing_table", bad_input_dynamodb_missing_table)
            .with_ignored_flag(!is_selected("dynamodb")),
    );
    trials.push(Trial::test("migrate::bad_input::firestore_unreachable_and_missing_index", bad_input_firestore));
    Some(trials)
}

fn find(backends: &[BackendHarness], name: &str) -> BackendHarness {
    let found = backends.iter().find(|b| b.name == name).expect("backend is in the harness");
    BackendHarness { name: found.name, describe: found.describe, fresh: found.fresh }
}

async fn fresh(make: FreshFn) -> Result<Ctx, Failed> {
    make().await.map_err(|e| Failed::from(format!("backend unavailable: {e}")))
}

fn id(user: &str, namespace: &str, key: &str) -> String {
    format!("{user}:{namespace}:{}", encode_key(key))
}

/// A document put at the source, and what the target must hold afterwards (`None`: nothing).
struct Seeded {
    id: String,
    body: Map<String, Value>,
    expected: Option<Map<String, Value>>,
}

/// A well-formed document in the spec's shape.
fn spec_body(user: &str, namespace: &str, key: &str, value: Value, n: usize) -> Map<String, Value> {
    let mut body = object(json!({
        "userId": user, "namespace": namespace, "key": key, "value": value,
        "metadata": {"n": n, "tags": ["a", "b"]},
        "createdByAgent": "seeder", "lastAccessedByAgent": format!("agent-{}", n % 3),
        "accessCount": n % 7,
        "createdAt": format!("2026-02-0{}T10:00:00Z", 1 + n % 5),
        "updatedAt": format!("2026-02-0{}T11:{:02}:00Z", 1 + n % 5, n % 60),
    }));
    if n.is_multiple_of(2) {
        body.insert("lastAccessedAt".into(), json!(format!("2026-02-0{}T12:00:00Z", 1 + n % 5)));
    }
    body
}

/// The generated data set: users × namespaces × keys, the round-trip corpus (values that survive
/// a double only, when a side cannot keep the others), the spec's example documents, documents
/// in the earlier schema revision's shape (the same fields; that revision differs in its indexes,
/// a `_design/data_store` design document, covered by `couchdb::design_documents_stay_behind`),
/// malformed-but-repairable documents, one foreign and one unrepairable document.
fn data_set(exact_numbers: bool) -> (Vec<Seeded>, String) {
    let mut docs = Vec::new();
    let plain = |body: Map<String, Value>, id: String| Seeded { id, expected: Some(body.clone()), body };
    let odd_keys = ["src/main.py", "a:b:c", "ünï 🚀", " ", "?#%/"];
    let mut n = 0;
    for user in USERS {
        for namespace in NAMESPACES {
            for i in 0..KEYS_PER_NAMESPACE {
                let key = if i < odd_keys.len() { odd_keys[i].to_owned() } else { format!("key-{i}") };
                n += 1;
                let value = json!({"i": i, "user": user, "list": [n, "x", null], "deep": {"f": 0.5}});
                docs.push(plain(spec_body(user, namespace, &key, value, n), id(user, namespace, &key)));
            }
        }
    }
    let mut left_out = 0;
    for case in crate::common::corpus::cases() {
        if !exact_numbers && !survives_f64(&case.value) {
            left_out += 1;
            continue;
        }
        n += 1;
        docs.push(plain(spec_body("corpus", "values", &case.name, case.value, n), id("corpus", "values", &case.name)));
    }
    let seeds: Vec<Value> =
        serde_json::from_str(include_str!("../../fixtures/seed-documents.json")).expect("seed documents are JSON");
    for seed in seeds {
        let mut body = object(seed);
        let Some(Value::String(seed_id)) = body.remove("_id") else { panic!("seed without _id") };
        docs.push(plain(body, seed_id));
    }
    // Earlier revision's example entry, `_rev` and all, as an old CouchDB deployment holds it.
    let mut earlier = object(json!({
        "userId": "user_123", "namespace": "default", "key": "my-key",
        "value": {"result": "analysis complete", "score": 95, "items": ["a", "b", "c"]},
        "metadata": {"version": "1.0", "source": "analyzer-agent"},
        "createdByAgent": "data-processor", "lastAccessedByAgent": "report-generator", "accessCount": 5,
        "createdAt": "2026-02-01T10:30:00Z", "updatedAt": "2026-02-05T14:22:00Z", "lastAccessedAt": "2026-02-05T14:22:00Z"
    }));
    docs.push(plain(earlier.clone(), id("user_123", "default", "my-key")));
    earlier.insert("key".into(), json!("with-unknown-field"));
    earlier.insert("legacyField".into(), json!({"kept": true}));
    docs.push(plain(earlier, id("user_123", "default", "with-unknown-field")));

    // Malformed but repairable: the expected bodies are written out by hand.
    let repaired = |key: &str, body: Value, expected: Value| Seeded {
        id: id("repair", "ns", key),
        body: object(body),
        expected: Some(object(expected)),
    };
    docs.push(repaired(
        "no-key",
        json!({"userId": "repair", "namespace": "ns", "value": 1, "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00Z"}),
        json!({"userId": "repair", "namespace": "ns", "value": 1, "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00Z", "key": "no-key"}),
    ));
    docs.push(repaired(
        "no-identity",
        json!({"namespace": "", "value": [1], "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00Z"}),
        json!({"namespace": "ns", "userId": "repair", "key": "no-identity", "value": [1], "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00Z"}),
    ));
    docs.push(repaired(
        "offset-timestamps",
        json!({"userId": "repair", "namespace": "ns", "key": "offset-timestamps", "value": 2,
               "createdAt": "2026-02-05T11:00:00+01:00", "updatedAt": "2026-02-05T10:00:00.250z",
               "lastAccessedAt": "2026-02-05T10:00:00.000Z"}),
        json!({"userId": "repair", "namespace": "ns", "key": "offset-timestamps", "value": 2,
               "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00.250Z",
               "lastAccessedAt": "2026-02-05T10:00:00Z"}),
    ));
    docs.push(repaired(
        "python-naive",
        json!({"userId": "repair", "namespace": "ns", "key": "python-naive", "value": 3,
               "createdAt": "2026-02-05T10:00:00.123456", "updatedAt": "2026-02-05 10:30:00"}),
        json!({"userId": "repair", "namespace": "ns", "key": "python-naive", "value": 3,
               "createdAt": "2026-02-05T10:00:00.123456Z", "updatedAt": "2026-02-05T10:30:00Z"}),
    ));
    docs.push(repaired(
        "no-created-at",
        json!({"userId": "repair", "namespace": "ns", "key": "no-created-at", "value": 4, "updatedAt": 1770285600}),
        json!({"userId": "repair", "namespace": "ns", "key": "no-created-at", "value": 4,
               "updatedAt": "2026-02-05T10:00:00Z", "createdAt": "2026-02-05T10:00:00Z"}),
    ));
    docs.push(repaired(
        "bad-timestamp-kept",
        json!({"userId": "repair", "namespace": "ns", "key": "bad-timestamp-kept", "value": 5,
               "createdAt": "sometime", "updatedAt": "2026-02-05T10:00:00Z"}),
        json!({"userId": "repair", "namespace": "ns", "key": "bad-timestamp-kept", "value": 5,
               "createdAt": "sometime", "updatedAt": "2026-02-05T10:00:00Z"}),
    ));
    // Not copied: a foreign document, and one whose userId contradicts its _id.
    docs.push(Seeded { id: "config-singleton".into(), body: object(json!({"type": "settings"})), expected: None });
    docs.push(Seeded {
        id: id("victim", "ns", "k"),
        body: object(json!({"userId": "intruder", "namespace": "ns", "key": "k", "value": 0})),
        expected: None,
    });
    let note = if left_out > 0 {
        format!("{left_out} corpus values beyond double precision left out (a side stores JS doubles)")
    } else {
        "the whole corpus".to_owned()
    };
    (docs, note)
}

const REPAIRED_DOCS: u64 = 5;

async fn seed(backend: &dyn DocumentBackend, docs: &[Seeded]) -> TestResult {
    for chunk in docs.chunks(50) {
        let writes = chunk
            .iter()
            .map(|d| BulkWrite { id: d.id.clone(), body: d.body.clone(), precondition: Precondition::MustNotExist })
            .collect();
        for (doc, result) in chunk.iter().zip(backend.bulk_write(writes).await?) {
            result.map_err(|e| format!("seeding {}: {e}", doc.id))?;
        }
    }
    Ok(())
}

fn options_in(dir: &Path, name: &str) -> Options {
    Options { checkpoint: Some(dir.join(format!("{name}.json"))), batch_size: 37, concurrency: 3, ..Options::default() }
}

fn migrate_job(source: &Ctx, target: &Ctx, options: Options) -> Job {
    Job {
        kind: JobKind::Migrate,
        source: Endpoint::backend(Arc::clone(&source.backend)),
        target: Endpoint::backend(Arc::clone(&target.backend)),
        options,
    }
}

async fn verify_ctx(
    source: &Ctx,
    target: &Ctx,
    options: &VerifyOptions,
) -> Result<migrate::verify::VerifyReport, Failed> {
    let source = Endpoint::backend(Arc::clone(&source.backend));
    let target = Endpoint::backend(Arc::clone(&target.backend));
    Ok(verify(&source, &target, options).await?)
}

/// Checks, field by field, that the target holds exactly what each seeded document expects.
async fn check_target(target: &dyn DocumentBackend, docs: &[Seeded]) -> TestResult {
    for doc in docs {
        let stored = target.get(&doc.id).await?;
        match (&doc.expected, stored) {
            (None, None) => {}
            (None, Some(_)) => return Err(format!("{} must not be copied, but the target has it", doc.id).into()),
            (Some(_), None) => return Err(format!("{} is missing at the target", doc.id).into()),
            (Some(expected), Some(stored)) => {
                let (expected, stored) = (Value::Object(expected.clone()), Value::Object(stored.body));
                check(exact_eq(&expected, &stored), || {
                    format!("{}: {}", doc.id, first_difference(&expected, &stored).unwrap_or_default())
                })?;
            }
        }
    }
    Ok(())
}

async fn pair_round_trip(make_source: FreshFn, make_target: FreshFn) -> TestResult {
    let source = fresh(make_source).await?;
    let target = fresh(make_target).await?;
    let exact = source.inexact_numbers.is_none() && target.inexact_numbers.is_none();
    let (docs, note) = data_set(exact);
    println!("{} -> {}: {} documents, {note}", source.backend.describe(), target.backend.describe(), docs.len());
    seed(source.backend.as_ref(), &docs).await?;
    let dir = tempfile::tempdir()?;
    let copyable = docs.iter().filter(|d| d.expected.is_some()).count() as u64;

    let report = migrate::run(migrate_job(&source, &target, options_in(dir.path(), "pair"))).await?;
    let c = &report.ledger.counts;
    check(c.read == docs.len() as u64 && c.written == copyable, || {
        format!("counts: {c:?}; issues: {:?}", report.ledger.issues)
    })?;
    check(c.foreign == 1 && c.malformed == 1 && c.repaired == REPAIRED_DOCS, || {
        format!("counts: {c:?}; issues: {:?}", report.ledger.issues)
    })?;
    check(report.ledger.warnings_by_rule.get("timestamp_unparseable") == Some(&1), || {
        format!("warnings: {:?}", report.ledger.warnings_by_rule)
    })?;
    check(report.exit_code() == migrate::EXIT_INCOMPLETE, || "one malformed document is left behind".into())?;
    let read_back = report.verification.as_ref().ok_or("migrate did not read back what it wrote")?;
    check(read_back.passed && read_back.compared == copyable && read_back.matching == copyable, || {
        format!("read-back: {read_back:?}")
    })?;

    let verified = verify_ctx(&source, &target, &VerifyOptions::default()).await?;
    check(verified.identical && verified.compared == copyable && verified.matching == copyable, || {
        format!("verify: {verified:?}")
    })?;
    check(verified.source_foreign == 1 && verified.source_malformed == 1, || format!("verify: {verified:?}"))?;
    check_target(target.backend.as_ref(), &docs).await?;

    let again = migrate::run(migrate_job(&source, &target, options_in(dir.path(), "pair"))).await?;
    check(again.status == migrate::report::Status::AlreadyFinished, || format!("re-run: {again:?}"))?;
    check(again.message.contains("already finished"), || again.message.clone())?;
    // A new checkpoint over a full target: everything is already there, nothing is rewritten.
    let fresh_run = migrate::run(migrate_job(&source, &target, options_in(dir.path(), "second"))).await?;
    let c = &fresh_run.ledger.counts;
    check(c.written == 0 && c.already_present == copyable, || format!("second migration: {c:?}"))
}

/// Three documents at the source; the target holds one of them identical and one different.
async fn conflict_setup(make: FreshFn) -> Result<(Ctx, Ctx, Map<String, Value>), Failed> {
    let source = fresh(make).await?;
    let target = fresh(make).await?;
    let docs: Vec<Seeded> = ["same", "differs", "new"]
        .iter()
        .enumerate()
        .map(|(n, key)| {
            let body = spec_body("u", "ns", key, json!(key), n);
            Seeded { id: id("u", "ns", key), expected: Some(body.clone()), body }
        })
        .collect();
    seed(source.backend.as_ref(), &docs).await?;
    let mut different = docs[1].body.clone();
    different.insert("value".into(), json!("the target's own"));
    seed(
        target.backend.as_ref(),
        &[
            Seeded { id: docs[0].id.clone(), body: docs[0].body.clone(), expected: None },
            Seeded { id: docs[1].id.clone(), body: different.clone(), expected: None },
        ],
    )
    .await?;
    Ok((source, target, different))
}

async fn conflict_policies(make: FreshFn) -> TestResult {
    let (source, target, different) = conflict_setup(make).await?;
    let dir = tempfile::tempdir()?;
    let differs = id("u", "ns", "differs");

    let err = migrate::run(migrate_job(&source, &target, options_in(dir.path(), "fail"))).await.expect_err("fail");
    check(err.kind() == ErrorKind::Conflict && err.to_string().contains(&differs), || format!("{err}"))?;
    let stored = target.backend.get(&differs).await?.ok_or("target lost its document")?;
    check(stored.body == different, || "the fail policy changed the target".into())?;

    // The same migration, now told to skip: it resumes and leaves the target's document alone.
    let skip = Options { on_conflict: ConflictPolicy::Skip, ..options_in(dir.path(), "fail") };
    let report = migrate::run(migrate_job(&source, &target, skip)).await?;
    let c = &report.ledger.counts;
    // The stopped run had written the batch's other new document: now it is already there.
    check(c.conflicts_skipped == 1 && c.already_present == 2 && c.written == 0, || format!("{c:?}"))?;
    check(report.ledger.issues.iter().any(|i| i.kind == "conflict_skipped" && i.id == differs), || {
        format!("{:?}", report.ledger.issues)
    })?;
    let stored = target.backend.get(&differs).await?.ok_or("target lost its document")?;
    check(stored.body == different, || "the skip policy changed the target".into())?;
    let verified = verify_ctx(&source, &target, &VerifyOptions::default()).await?;
    check(!verified.identical && verified.different_ids == [differs.clone()], || format!("{verified:?}"))?;
    // The read-back sees the skipped document differ, and passes: the report already names it.
    let read_back = report.verification.as_ref().ok_or("no read-back")?;
    check(read_back.passed && read_back.different == 1 && read_back.explained == 1, || format!("{read_back:?}"))?;
    check(report.exit_code() == 0, || format!("exit {}", report.exit_code()))?;

    let overwrite = Options { on_conflict: ConflictPolicy::Overwrite, restart: true, ..options_in(dir.path(), "fail") };
    let report = migrate::run(migrate_job(&source, &target, overwrite)).await?;
    let c = &report.ledger.counts;
    check(c.overwritten == 1 && c.already_present == 2, || format!("{c:?}"))?;
    let verified = verify_ctx(&source, &target, &VerifyOptions::default()).await?;
    check(verified.identical, || format!("{verified:?}"))?;

    // A document only the target has is extra; one that is no data-store document is not.
    let only_at_target = id("u", "ns", "only-at-target");
    let body = spec_body("u", "ns", "only-at-target", json!(1), 1);
    seed(target.backend.as_ref(), &[Seeded { id: only_at_target.clone(), body, expected: None }]).await?;
    target.backend.put("foreign-doc", &object(json!({"type": "other"})), Precondition::MustNotExist).await?;
    let verified = verify_ctx(&source, &target, &VerifyOptions::default()).await?;
    check(!verified.identical && verified.extra == 1 && verified.extra_ids == [only_at_target], || {
        format!("{verified:?}")
    })?;
    check(verified.target_foreign == 1 && verified.missing == 0 && verified.different == 0, || format!("{verified:?}"))
}

async fn seeded_pair(make: FreshFn) -> Result<(Ctx, Ctx, Vec<Seeded>), Failed> {
    let source = fresh(make).await?;
    let target = fresh(make).await?;
    let mut docs = Vec::new();
    for (n, user) in USERS.iter().enumerate() {
        for namespace in NAMESPACES {
            for i in 0..4 {
                let key = format!("k{i}");
                let body = spec_body(user, namespace, &key, json!(i), n * 10 + i);
                docs.push(Seeded { id: id(user, namespace, &key), expected: Some(body.clone()), body });
            }
        }
    }
    seed(source.backend.as_ref(), &docs).await?;
    Ok((source, target, docs))
}

async fn count_all(backend: &dyn DocumentBackend) -> Result<usize, Failed> {
    let mut token = None;
    let mut count = 0;
    loop {
        let page = backend.scan(100, token.as_deref()).await?;
        count += page.items.len();
        match page.next {
            Some(next) => token = Some(next),
            None => return Ok(count),
        }
    }
}

async fn filters(make: FreshFn) -> TestResult {
    let (source, target, docs) = seeded_pair(make).await?;
    let dir = tempfile::tempdir()?;
    let filter = Filter { users: vec!["bob".into()], namespaces: vec!["files:my-repo".into(), "default".into()] };
    let options = Options { filter: filter.clone(), ..options_in(dir.path(), "filtered") };
    let report = migrate::run(migrate_job(&source, &target, options)).await?;
    let wanted: Vec<&Seeded> =
        docs.iter().filter(|d| d.id.starts_with("bob:files:my-repo:") || d.id.starts_with("bob:default:")).collect();
    let c = &report.ledger.counts;
    check(c.written == wanted.len() as u64 && c.filtered_out == (docs.len() - wanted.len()) as u64, || {
        format!("{c:?}")
    })?;
    check(count_all(target.backend.as_ref()).await? == wanted.len(), || "target holds other documents".into())?;
    for doc in wanted {
        check(target.backend.get(&doc.id).await?.is_some(), || format!("{} missing", doc.id))?;
    }
    let same_filter = VerifyOptions { filter, ..VerifyOptions::default() };
    check(verify_ctx(&source, &target, &same_filter).await?.identical, || "filtered verify differs".into())?;
    let whole = verify_ctx(&source, &target, &VerifyOptions::default()).await?;
    check(!whole.identical && whole.missing == c.filtered_out, || format!("{whole:?}"))?;
    check(whole.exit_code() == migrate::EXIT_DIFFERENT, || "verify exit status".into())
}

/// The run records (`_local/:run:{command}-…`) `target` holds for `command`.
async fn run_records(target: &dyn DocumentBackend, command: &str) -> Result<Vec<Map<String, Value>>, Failed> {
    let prefix = format!(":run:{command}-");
    let range = agentstore::backend::IdRange {
        start: Some(prefix.clone()),
        end: Some(format!(":run:{command}.")),
        inclusive_end: false,
        descending: false,
        include_design: false,
    };
    let page = target.local_docs(&range, 100, None).await?;
    Ok(page.items.into_iter().map(|record| record.body).collect())
}

/// A `verify` asked to keep a record (the command's) leaves one in its target, finished, with what
/// it compared; without asking it leaves none.
async fn verify_keeps_a_record(make: FreshFn) -> TestResult {
    let (source, target, docs) = seeded_pair(make).await?;
    let dir = tempfile::tempdir()?;
    migrate::run(migrate_job(&source, &target, options_in(dir.path(), "recorded"))).await?;
    verify_ctx(&source, &target, &VerifyOptions::default()).await?;
    check(run_records(target.backend.as_ref(), "verify").await?.is_empty(), || "a record nobody asked for".into())?;
    let report = verify_ctx(&source, &target, &VerifyOptions { record: true, ..VerifyOptions::default() }).await?;
    check(report.identical, || format!("{report:?}"))?;
    let records = run_records(target.backend.as_ref(), "verify").await?;
    check(records.len() == 1, || format!("{records:?}"))?;
    let record = &records[0];
    let n = json!(docs.len());
    check(record["state"] == "finished" && record["read"] == n && record["landed"] == n, || format!("{record:?}"))?;
    check(record["source"] == json!(Endpoint::backend(Arc::clone(&source.backend)).name()), || format!("{record:?}"))
}

async fn dry_run_writes_nothing(make: FreshFn) -> TestResult {
    let (source, target, docs) = seeded_pair(make).await?;
    seed(target.backend.as_ref(), &docs[..1]).await?;
    let dir = tempfile::tempdir()?;
    let mut changed = docs[1].body.clone();
    changed.insert("value".into(), json!("different"));
    seed(target.backend.as_ref(), &[Seeded { id: docs[1].id.clone(), body: changed, expected: None }]).await?;
    let options = Options { dry_run: true, ..options_in(dir.path(), "dry") };
    let report = migrate::run(migrate_job(&source, &target, options)).await?;
    let c = &report.ledger.counts;
    check(c.would_write == docs.len() as u64 - 2 && c.already_present == 1 && c.would_conflict == 1, || {
        format!("{c:?}")
    })?;
    check(c.written == 0 && report.status == migrate::report::Status::DryRun, || format!("{report:?}"))?;
    check(count_all(target.backend.as_ref()).await? == 2, || "the dry run wrote to the target".into())?;
    check(!dir.path().join("dry.json").exists(), || "the dry run wrote a checkpoint".into())
}

async fn access_tracking_reset(make: FreshFn) -> TestResult {
    let (source, target, docs) = seeded_pair(make).await?;
    let dir = tempfile::tempdir()?;
    let options = Options { access_tracking: AccessTracking::Reset, ..options_in(dir.path(), "reset") };
    migrate::run(migrate_job(&source, &target, options)).await?;
    for doc in &docs {
        let stored = target.backend.get(&doc.id).await?.ok_or("missing")?;
        check(stored.body.get("accessCount") == Some(&json!(0)), || format!("{}: {:?}", doc.id, stored.body))?;
        check(!stored.body.contains_key("lastAccessedAt") && !stored.body.contains_key("lastAccessedByAgent"), || {
            format!("{}: last access kept", doc.id)
        })?;
        check(stored.body.get("createdByAgent") == doc.body.get("createdByAgent"), || "createdByAgent lost".into())?;
    }
    let same = VerifyOptions { access_tracking: AccessTracking::Reset, ..VerifyOptions::default() };
    check(verify_ctx(&source, &target, &same).await?.identical, || "reset verify differs".into())?;
    let kept = verify_ctx(&source, &target, &VerifyOptions::default()).await?;
    check(kept.different > 0, || "verify with keep must see the reset fields".into())
}

async fn changed_parameters_are_refused(make: FreshFn) -> TestResult {
    let (source, target, _) = seeded_pair(make).await?;
    let dir = tempfile::tempdir()?;
    migrate::run(migrate_job(&source, &target, options_in(dir.path(), "cp"))).await?;
    let other = Options { access_tracking: AccessTracking::Reset, ..options_in(dir.path(), "cp") };
    let err = migrate::run(migrate_job(&source, &target, other)).await.expect_err("refused");
    check(err.kind() == ErrorKind::InvalidInput && err.to_string().contains("--restart"), || err.to_string())
}

fn file_job(kind: JobKind, source: Endpoint, target: Endpoint, options: Options) -> Job {
    Job { kind, source, target, options }
}

async fn export_import_round_trip(make: FreshFn) -> TestResult {
    let source = fresh(make).await?;
    let (docs, _) = data_set(true);
    seed(source.backend.as_ref(), &docs).await?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("backup.ndjson");
    let export = migrate::run(file_job(
        JobKind::Export,
        Endpoint::backend(Arc::clone(&source.backend)),
        Endpoint::File(file.clone()),
        options_in(dir.path(), "export"),
    ))
    .await?;
    let copyable = docs.iter().filter(|d| d.expected.is_some()).count();
    check(export.ledger.counts.written == copyable as u64, || format!("{:?}", export.ledger.counts))?;
    let text = std::fs::read_to_string(&file)?;
    let lines: Vec<Value> = text.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    check(lines.len() == copyable && lines.iter().all(|l| l["_id"].is_string() && l["_rev"].is_string()), || {
        format!("{} lines", lines.len())
    })?;

    let target = fresh(make).await?;
    let import = migrate::run(file_job(
        JobKind::Import,
        Endpoint::File(file.clone()),
        Endpoint::backend(Arc::clone(&target.backend)),
        options_in(dir.path(), "import"),
    ))
    .await?;
    check(import.ledger.counts.written == copyable as u64, || format!("{:?}", import.ledger.counts))?;
    check(verify_ctx(&source, &target, &VerifyOptions::default()).await?.identical, || "verify differs".into())?;
    check_target(target.backend.as_ref(), &docs).await
}

async fn export_resume_truncates(make: FreshFn) -> TestResult {
    let (source, _, docs) = seeded_pair(make).await?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("out.ndjson");
    let job = |restart| {
        file_job(
            JobKind::Export,
            Endpoint::backend(Arc::clone(&source.backend)),
            Endpoint::File(file.clone()),
            Options { restart, batch_size: 5, ..options_in(dir.path(), "export") },
        )
    };
    migrate::run(job(false)).await?;
    let complete = std::fs::read_to_string(&file)?;
    // Make it look like a run killed after its third batch's checkpoint, with a torn line after.
    let cp_path = dir.path().join("export.json");
    let mut checkpoint = migrate::checkpoint::load(&cp_path)?.ok_or("no checkpoint")?;
    let first_15: usize = complete.lines().take(15).map(|l| l.len() + 1).sum();
    let last_id = serde_json::from_str::<Value>(complete.lines().nth(14).ok_or("short export")?)?["_id"].clone();
    checkpoint.finished = false;
    checkpoint.output_bytes = Some(first_15 as u64);
    checkpoint.position = migrate::source::Position::Scan { token: last_id.as_str().ok_or("id")?.to_owned() };
    migrate::checkpoint::save(&cp_path, &checkpoint)?;
    std::fs::write(&file, format!("{}{{\"_id\": \"torn", &complete[..first_15 + 40]))?;
    let report = migrate::run(job(false)).await?;
    check(report.resumed, || "did not resume".into())?;
    check(std::fs::read_to_string(&file)? == complete, || "resumed export differs from the complete one".into())?;
    check(complete.lines().count() == docs.len(), || "line count".into())
}

async fn import_reports_unreadable_lines(make: FreshFn) -> TestResult {
    let target = fresh(make).await?;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("in.ndjson");
    let good = json!({"_id": id("u", "ns", "k"), "userId": "u", "namespace": "ns", "key": "k", "value": 1,
                      "createdAt": "2026-02-05T10:00:00Z", "updatedAt": "2026-02-05T10:00:00Z"});
    std::fs::write(&file, format!("{good}\n\nnot json\n[1,2]\n{{\"value\": 1}}\n"))?;
    let report = migrate::run(file_job(
        JobKind::Import,
        Endpoint::File(file),
        Endpoint::backend(Arc::clone(&target.backend)),
        options_in(dir.path(), "import"),
    ))
    .await?;
    let c = &report.ledger.counts;
    check(c.written == 1 && c.unreadable == 3, || format!("{c:?}"))?;
    let lines: Vec<&str> =
        report.ledger.issues.iter().filter(|i| i.kind == "unreadable").map(|i| i.id.as_str()).collect();
    check(lines == ["line 3", "line 4", "line 5"], || format!("{lines:?}"))?;
    check(report.exit_code() == migrate::EXIT_INCOMPLETE, || "exit status".into())
}

/// A CouchDB database of the earlier schema revision: data documents plus its
/// `_design/data_store` design document, which must stay behind.
async fn couchdb_design_documents_stay_behind() -> TestResult {
    let server = crate::common::servers::couchdb()?;
    let database = format!("migrate_legacy_{}", std::process::id());
    let url = server.database_url(&database);
    let config = agentstore::backend::couchdb::CouchConfig::parse(&url)?;
    let source: Arc<dyn DocumentBackend> = Arc::new(agentstore::backend::couchdb::CouchDbBackend::open(&config).await?);
    let design = json!({"_id": "_design/data_store", "views": {
        "by_user_namespace": {"map": "function(doc) { if (doc.userId && doc.namespace) { emit([doc.userId, doc.namespace], null); } }"},
        "by_user": {"map": "function(doc) { if (doc.userId) { emit(doc.userId, doc.namespace); } }"}}});
    let base = server.url.clone();
    let (credentials, host) = base.trim_start_matches("http://").split_once('@').ok_or("server url")?;
    let (user, password) = credentials.split_once(':').ok_or("credentials")?;
    let response = reqwest::Client::new()
        .put(format!("http://{host}/{database}/_design/data_store"))
        .basic_auth(user, Some(password))
        .json(&design)
        .send()
        .await?;
    check(response.status().is_success(), || format!("design document: {}", response.status()))?;
    let body = spec_body("user_123", "default", "greeting", json!("Hello, World!"), 1);
    source.put(&id("user_123", "default", "greeting"), &body, Precondition::MustNotExist).await?;

    let census = migrate::census::design_documents(&Endpoint::backend(Arc::clone(&source))).await?;
    check(census == Some(1), || format!("design documents counted: {census:?}"))?;
    let dir = tempfile::tempdir()?;
    let target: Arc<dyn DocumentBackend> = Arc::new(EmbeddedBackend::open(&dir.path().join("t.redb")).await?);
    let report = migrate::run(Job {
        kind: JobKind::Migrate,
        source: Endpoint::backend(Arc::clone(&source)),
        target: Endpoint::backend(Arc::clone(&target)),
        options: options_in(dir.path(), "legacy"),
    })
    .await?;
    check(report.ledger.counts.written == 1, || format!("{:?}", report.ledger.counts))?;
    check(target.get("_design/data_store").await?.is_none(), || "design document copied".into())?;
    check(count_all(target.as_ref()).await? == 1, || "target holds more than the data document".into())?;
    let after = reqwest::Client::new()
        .get(format!("http://{host}/{database}/_design/data_store"))
        .basic_auth(user, Some(password))
        .send()
        .await?;
    check(after.status().is_success(), || "the source's design document is gone".into())
}

/// A document the CouchDB target would store with another number is counted and listed as
/// refused (exit 7), never written altered; its neighbours in the same batch are written.
async fn couchdb_numbers_are_refused(make_source: FreshFn, make_target: FreshFn) -> TestResult {
    let source = fresh(make_source).await?;
    let target = fresh(make_target).await?;
    let docs = [
        ("plain", json!({"n": 1.5})),
        ("pi", json!({"pi": serde_json::from_str::<Value>("3.141592653589793238462643383279")?})),
        ("min-subnormal", json!({"m": [serde_json::from_str::<Value>("5e-324")?]})),
    ];
    for (n, (key, value)) in docs.iter().enumerate() {
        let body = spec_body("alice", "numbers", key, value.clone(), n);
        source.backend.put(&id("alice", "numbers", key), &body, Precondition::MustNotExist).await?;
    }
    let dir = tempfile::tempdir()?;
    let report = migrate::run(migrate_job(&source, &target, options_in(dir.path(), "numbers"))).await?;
    let c = &report.ledger.counts;
    check(c.read == 3 && c.written == 2 && c.refused == 1 && c.failed == 0, || format!("counts: {c:?}"))?;
    check(report.exit_code() == migrate::EXIT_INCOMPLETE, || {
        format!(
            "a refused document makes the run incomplete (exit 7), got {}: {:?}",
            report.exit_code(),
            report.verification
        )
    })?;
    let verification = report.verification.as_ref().ok_or("the migration reads back what it wrote")?;
    check(verification.passed && verification.missing == 1 && verification.explained == 1, || {
        format!("the refused document is the read-back's one explained absence: {verification:?}")
    })?;
    let pi = id("alice", "numbers", "pi");
    let issue = report.ledger.issues.iter().find(|issue| issue.id == pi);
    check(issue.is_some_and(|issue| issue.kind == "refused" && issue.reason.contains("invalid value.pi")), || {
        format!("issues: {:?}", report.ledger.issues)
    })?;
    check(target.backend.get(&pi).await?.is_none(), || "the refused document was written".into())?;
    let subnormal = target.backend.get(&id("alice", "numbers", "min-subnormal")).await?.ok_or("not copied")?;
    check(exact_eq(&subnormal.body["value"], &docs[2].1), || format!("5e-324 came back as {}", subnormal.body["value"]))
}

// ---- the real binary ----

fn run_agentstore(dir: &Path, args: &[&str]) -> Result<Output, Failed> {
    Ok(agentstore(dir).args(args).output()?)
}

fn stdout_json(output: &Output) -> Result<Value, Failed> {
    serde_json::from_slice(&output.stdout).map_err(|e| {
        format!(
            "stdout is not JSON ({e}): {}; stderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .into()
    })
}

/// Kill moments from a seeded xorshift generator (the seed is printed, so a failure can be
/// replayed).
struct KillClock(u64);

impl KillClock {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

enum CrashTarget {
    Embedded,
    DynamoDb,
    Firestore,
}

const CRASH_DOCS: usize = 5_000;
const KILLS: usize = 5;

fn crash_and_resume(target: CrashTarget) -> TestResult {
    let dir = tempfile::tempdir()?;
    let source_path = dir.path().join("source.redb");
    block_on(async {
        let source = EmbeddedBackend::open(&source_path).await?;
        let docs: Vec<Seeded> = (0..CRASH_DOCS)
            .map(|i| {
                let (user, namespace, key) = (USERS[i % 3], NAMESPACES[(i / 3) % 3], format!("key-{i}"));
                let body = spec_body(user, namespace, &key, json!({"i": i}), i);
                Seeded { id: id(user, namespace, &key), body, expected: None }
            })
            .collect();
        seed(&source, &docs).await
    })?;
    let from = format!("embedded:{}", source_path.display());
    let to = match target {
        CrashTarget::Embedded => format!("embedded:{}", dir.path().join("target.redb").display()),
        CrashTarget::DynamoDb => {
            crate::common::servers::dynamodb()?.table_url(&format!("migrate_crash_{}", std::process::id()))
        }
        CrashTarget::Firestore => {
            crate::common::servers::firestore()?.collection_url(&format!("migrate_crash_{}", std::process::id()))
        }
    };
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
    let mut random = KillClock(seed | 1);
    let migrate_args = [
        "migrate",
        "--from",
        &from,
        "--to",
        &to,
        "--batch-size",
        "40",
        "--concurrency",
        "3",
        "--checkpoint",
        "cp.json",
        "--progress",
        "none",
    ];
    // Kill moments spread over roughly the time a whole run takes on this target.
    let window_ms = match target {
        CrashTarget::Embedded => 200,
        CrashTarget::DynamoDb | CrashTarget::Firestore => 1000,
    };
    let mut kills = 0;
    let started = Instant::now();
    for _ in 0..KILLS {
        let mut child =
            agentstore(dir.path()).args(migrate_args).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        let wait = Duration::from_millis(30 + random.next() % window_ms);
        std::thread::sleep(wait);
        if child.try_wait()?.is_none() {
            child.kill()?; // SIGKILL
            kills += 1;
        }
        child.wait()?;
    }
    let finished = run_agentstore(dir.path(), &migrate_args)?;
    let report = stdout_json(&finished)?;
    println!(
        "seed {seed}: killed {kills} of {KILLS} runs, then {} ({} runs, counts {}) in {:.1}s",
        report["status"],
        report["runs"],
        report["counts"],
        started.elapsed().as_secs_f64()
    );
    check(finished.status.code() == Some(0), || format!("final run: {}", String::from_utf8_lossy(&finished.stderr)))?;
    let landed = ["written", "already_present"].iter().map(|k| report["counts"][k].as_u64().unwrap_or(0)).sum::<u64>();
    // A run killed just after its last checkpoint leaves the migration finished already.
    let done = report["status"] == "finished" || report["status"] == "already_finished";
    check(done && landed == CRASH_DOCS as u64 && report["counts"]["read"] == CRASH_DOCS, || format!("{report}"))?;
    check(kills > 0, || "every run ended before it could be killed".into())?;
    // The read-back covers the whole migration, the parts written by the killed runs too.
    let read_back = &report["verification"];
    check(read_back["passed"] == true && read_back["compared"] == CRASH_DOCS, || format!("{read_back}"))?;
    let again = stdout_json(&run_agentstore(dir.path(), &migrate_args)?)?;
    check(again["status"] == "already_finished", || format!("{again}"))?;

    let verified = run_agentstore(dir.path(), &["verify", "--from", &from, "--to", &to, "--progress", "none"])?;
    let verdict = stdout_json(&verified)?;
    check(verified.status.code() == Some(0) && verdict["identical"] == true, || format!("{verdict}"))?;
    check(verdict["matching"] == CRASH_DOCS && verdict["extra"] == 0, || format!("{verdict}"))
}

/// A target that acknowledges every write but stores one document's `value` altered, as a real
/// CouchDB does with numbers it cannot hold exactly.
struct AlteringTarget {
    inner: Arc<dyn DocumentBackend>,
    victim: String,
}

impl AlteringTarget {
    fn alter(&self, id: &str, body: &Map<String, Value>) -> Map<String, Value> {
        let mut body = body.clone();
        if id == self.victim {
            body.insert("value".into(), json!(0.0));
        }
        body
    }
}

#[async_trait::async_trait]
impl Layered for AlteringTarget {
    fn inner(&self) -> &dyn DocumentBackend {
        self.inner.as_ref()
    }
    fn describe(&self) -> String {
        format!("altering {}", self.inner.describe())
    }
    async fn put(
        &self,
        id: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> agentstore::Result<agentstore::backend::Revision> {
        self.inner.put(id, &self.alter(id, body), precondition).await
    }
    async fn bulk_write(
        &self,
        writes: Vec<BulkWrite>,
    ) -> agentstore::Result<Vec<agentstore::Result<agentstore::backend::Revision>>> {
        let writes = writes.into_iter().map(|w| BulkWrite { body: self.alter(&w.id, &w.body), ..w }).collect();
        self.inner.bulk_write(writes).await
    }
}

async fn read_back_catches_alterations(make: FreshFn) -> TestResult {
    let (source, target) = (fresh(make).await?, fresh(make).await?);
    let docs: Vec<Seeded> = (0..100)
        .map(|n| {
            let key = format!("k{n}");
            Seeded { id: id("u", "ns", &key), body: spec_body("u", "ns", &key, json!(5e-324), n), expected: None }
        })
        .collect();
    seed(source.backend.as_ref(), &docs).await?;
    let victim = docs[42].id.clone();
    let dir = tempfile::tempdir()?;
    let job = |target: &Ctx, options| Job {
        kind: JobKind::Migrate,
        source: Endpoint::backend(Arc::clone(&source.backend)),
        target: Endpoint::backend(Arc::new(AlteringTarget {
            inner: Arc::clone(&target.backend),
            victim: victim.clone(),
        })),
        options,
    };

    // Without the read-back the run looks perfect.
    let unverified =
        migrate::run(job(&target, Options { verify: false, ..options_in(dir.path(), "unverified") })).await?;
    check(unverified.verification.is_none() && unverified.exit_code() == 0, || format!("{unverified:?}"))?;
    check(unverified.ledger.counts.written == 100, || format!("{:?}", unverified.ledger.counts))?;

    // With it (the default), the altered document is named and the exit status is 6.
    let second = fresh(make).await?;
    let report = migrate::run(job(&second, options_in(dir.path(), "verified"))).await?;
    let read_back = report.verification.as_ref().ok_or("no read-back by default")?;
    check(!read_back.passed && read_back.different == 1 && read_back.different_ids == [victim.clone()], || {
        format!("{read_back:?}")
    })?;
    check(read_back.compared == 100 && read_back.matching == 99 && read_back.message.contains("NOT verified"), || {
        format!("{read_back:?}")
    })?;
    check(report.exit_code() == migrate::EXIT_DIFFERENT, || format!("exit {}", report.exit_code()))?;
    // Run again, it is already finished, and still says the target is wrong.
    let again = migrate::run(job(&second, options_in(dir.path(), "verified"))).await?;
    check(again.status == migrate::report::Status::AlreadyFinished, || format!("{again:?}"))?;
    check(again.exit_code() == migrate::EXIT_DIFFERENT, || format!("re-run exit {}", again.exit_code()))
}

/// The binary reads back by default and says so in its report; `--no-verify` leaves it out.
fn migrate_reads_back_unless_no_verify() -> TestResult {
    let dir = tempfile::tempdir()?;
    let from = small_source(dir.path())?;
    let to = format!("embedded:{}", dir.path().join("target.redb").display());
    let args = ["migrate", "--from", &from, "--to", &to, "--progress", "none"];
    let output = run_agentstore(dir.path(), &args)?;
    check(output.status.code() == Some(0), || String::from_utf8_lossy(&output.stderr).into_owned())?;
    let report = stdout_json(&output)?;
    check(report["verification"]["passed"] == true && report["verification"]["matching"] == 1, || format!("{report}"))?;
    let mut unverified = args.to_vec();
    unverified.extend(["--restart", "--no-verify"]);
    let output = run_agentstore(dir.path(), &unverified)?;
    let report = stdout_json(&output)?;
    check(output.status.code() == Some(0) && report.get("verification").is_none(), || format!("{report}"))
}

fn closed_port() -> Result<u16, Failed> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Seeds a small embedded source in `dir` and returns its URL.
fn small_source(dir: &Path) -> Result<String, Failed> {
    let path = dir.join("source.redb");
    block_on(async {
        let source = EmbeddedBackend::open(&path).await?;
        let body = spec_body("u", "ns", "k", json!(1), 1);
        seed(&source, &[Seeded { id: id("u", "ns", "k"), body, expected: None }]).await
    })?;
    Ok(format!("embedded:{}", path.display()))
}

fn expect_refusal(output: &Output, code: i32, words: &[&str]) -> TestResult {
    let stderr = String::from_utf8_lossy(&output.stderr);
    check(output.status.code() == Some(code), || format!("exit {:?}, stderr: {stderr}", output.status.code()))?;
    check(output.stdout.is_empty(), || "a report was printed".into())?;
    for word in words {
        check(stderr.contains(word), || format!("stderr lacks {word:?}: {stderr}"))?;
    }
    Ok(())
}

fn bad_input_unreachable_source() -> TestResult {
    let dir = tempfile::tempdir()?;
    let from = format!("couchdb+http://admin:password@127.0.0.1:{}/db", closed_port()?);
    let to = format!("embedded:{}", dir.path().join("target.redb").display());
    let output = run_agentstore(dir.path(), &["migrate", "--from", &from, "--to", &to])?;
    expect_refusal(&output, 5, &["unavailable", "source"])?;
    check(!stderr_has(&output, "password"), || "the password was printed".into())?;
    check(!dir.path().join("target.redb").exists(), || "the target was created".into())
}

fn stderr_has(output: &Output, text: &str) -> bool {
    String::from_utf8_lossy(&output.stderr).contains(text)
}

fn bad_input_unreachable_target() -> TestResult {
    let dir = tempfile::tempdir()?;
    let from = small_source(dir.path())?;
    let to = format!("dynamodb://tbl?region=us-east-1&endpoint=http://127.0.0.1:{}", closed_port()?);
    let output = agentstore(dir.path())
        .args(["migrate", "--from", &from, "--to", &to])
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .output()?;
    expect_refusal(&output, 5, &["unavailable", "target"])?;
    let leftovers: Vec<PathBuf> = std::fs::read_dir(dir.path())?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    check(leftovers.len() == 1, || format!("files written: {leftovers:?}"))
}

fn bad_input_missing_embedded_source() -> TestResult {
    let dir = tempfile::tempdir()?;
    let from = format!("embedded:{}", dir.path().join("nowhere.redb").display());
    let to = format!("embedded:{}", dir.path().join("target.redb").display());
    let output = run_agentstore(dir.path(), &["migrate", "--from", &from, "--to", &to])?;
    expect_refusal(&output, 2, &["source", "does not exist"])?;
    check(std::fs::read_dir(dir.path())?.count() == 0, || "files were created".into())
}

fn bad_input_couchdb() -> TestResult {
    let server = crate::common::servers::couchdb()?;
    let dir = tempfile::tempdir()?;
    let from = small_source(dir.path())?;
    let database = format!("migrate_refused_{}", std::process::id());
    let host = server.url.rsplit('@').next().ok_or("server url")?;
    let wrong = format!("couchdb+{}/{database}?create=true", server.url.replace("admin:password", "admin:wrong"));
    let output = run_agentstore(dir.path(), &["migrate", "--from", &from, "--to", &wrong])?;
    expect_refusal(&output, 5, &["unauthorized", "target"])?;
    check(!stderr_has(&output, "wrong"), || "the password was printed".into())?;
    let missing = format!("couchdb+{}/{database}", server.url);
    let output = run_agentstore(dir.path(), &["migrate", "--from", &from, "--to", &missing])?;
    expect_refusal(&output, 5, &["misconfigured", "target", "does not exist"])?;
    block_on(async {
        let response = reqwest::Client::new()
            .get(format!("http://{host}/{database}"))
            .basic_auth("admin", Some("password"))
            .send()
            .await?;
        check(response.status() == reqwest::StatusCode::NOT_FOUND, || {
            format!("the target database exists: {}", response.status())
        })
    })
}

fn bad_input_dynamodb_missing_table() -> TestResult {
    let server = crate::common::servers::dynamodb()?;
    let dir = tempfile::tempdir()?;
    let from = small_source(dir.path())?;
    let table = format!("migrate_missing_{}", std::process::id());
    let to = server.table_url(&table).replace("&create=true", "");
    let output = run_agentstore(dir.path(), &["migrate", "--from", &from, "--to", &to])?;
    expect_refusal(&output, 5, &["misconfigured", "target", "does not exist"])?;
    // Asking again (still without create) finds it still missing: nothing was created.
    let again = run_agentstore(dir.path(), &["verify", "--from", &from, "--to", &to])?;
    expect_refusal(&again, 5, &["does not exist"])
}

/// Firestore: an emulator address nobody answers on, and a Firestore (a wiremock server standing in
/// for production, which the emulator cannot be: it needs no indexes) that answers the listing
/// query with the missing-index error. Both are refused before anything is written.
fn bad_input_firestore() -> TestResult {
    use wiremock::matchers::{method, path_regex};
    use wiremock::{Mock, MockServer, ResponseTemplate};

    let dir = tempfile::tempdir()?;
    let from = small_source(dir.path())?;
    let to = format!("firestore://agentstore-test?emulator=127.0.0.1:{}&timeout_ms=2000", closed_port()?);
    let output = run_agentstore(dir.path(), &["migrate", "--from", &from, "--to", &to])?;
    expect_refusal(&output, 5, &["unavailable", "target"])?;

    block_on(async {
        let server = MockServer::start().await;
        let link =
            "https://console.firebase.google.com/v1/r/project/agentstore-test/firestore/indexes?create_composite=Cg";
        Mock::given(method("POST"))
            .and(path_regex(":runQuery$"))
            .and(wiremock::matchers::body_string_contains("compositeFilter"))
            .respond_with(ResponseTemplate::new(400).set_body_json(json!({"error": {
                "code": 400,
                "status": "FAILED_PRECONDITION",
                "message": format!("The query requires an index. You can create it here: {link}")
            }})))
            .mount(&server)
            .await;
        // Opening finds no layout marker and an empty collection, so it writes the marker.
        Mock::given(method("POST"))
            .and(path_regex(":batchGet$"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!([{
                "missing": "projects/agentstore-test/databases/(default)/documents/agent_data_store_meta/layout",
                "readTime": "2026-11-21T08:00:00Z"
            }])))
            .mount(&server)
            .await;
        Mock::given(method("POST"))
            .and(path_regex(":commit$"))
            .and(wiremock::matchers::body_string_contains("_meta/layout"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!({
                "writeResults": [{"updateTime": "2026-11-21T08:00:00Z"}], "commitTime": "2026-11-21T08:00:00Z"
            })))
            .mount(&server)
            .await;
        // The health check (no filter) finds an empty collection.
        Mock::given(method("POST"))
            .and(path_regex(":runQuery$"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!([{"readTime": "2026-11-21T08:00:00Z"}])))
            .mount(&server)
            .await;
        let to = format!("firestore://agentstore-test?emulator={}", server.address());
        let dir = dir.path().to_owned();
        let from = from.clone();
        let output =
            tokio::task::spawn_blocking(move || run_agentstore(&dir, &["migrate", "--from", &from, "--to", &to]))
                .await
                .map_err(|e| Failed::from(e.to_string()))??;
        expect_refusal(&output, 5, &["misconfigured", "target", "index", link])?;
        let requests = server.received_requests().await.unwrap_or_default();
        // No document was written: the layout marker (in the `_meta` collection) is no data.
        let writes: Vec<String> = requests
            .iter()
            .filter(|r| !String::from_utf8_lossy(&r.body).contains("_meta/layout"))
            .map(|r| r.url.path().to_owned())
            .filter(|p| p.ends_with(":commit") || p.ends_with(":batchWrite"))
            .collect();
        check(writes.is_empty(), || format!("writes were sent: {writes:?}"))
    })
}
