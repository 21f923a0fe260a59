//! A target document changed behind the migration's back, under each `--on-conflict` policy.

use super::*;

pub(super) async fn target_changed_independently(from: Backend, to: Backend) -> TestResult {
    let dir = tempfile::tempdir()?;
    let dir = dir.path();
    let source = Side::fresh(from, dir, "source").await?;
    let target = Side::fresh(to, dir, "target").await?;
    println!("{} -> {}: conflict policies in the follow phase", source.describe(), target.describe());
    let docs: Vec<(String, Map<String, Value>)> = (0..20)
        .map(|i| {
            let key = format!("k{i}");
            (doc_id("u", "ns", &key), spec_body("u", "ns", &key, json!(i), i))
        })
        .collect();
    seed(source.open().await?.as_ref(), &docs).await?;
    run_until_caught_up(dir, &source, &target, &[])?;

    let (user, namespace, key) = ("u", "ns", "k7");
    let victim = doc_id(user, namespace, key);
    let targets_own = {
        let backend = target.open().await?;
        let stored = backend.get(&victim).await?.ok_or("the copy did not copy k7")?;
        let mut body = stored.body;
        body.insert("value".into(), json!("the target's own"));
        backend.put(&victim, &body, Precondition::MatchRevision(stored.rev)).await?;
        body
    };
    let set_at_source = |value: Value| {
        let source = &source;
        async move {
            let store = DataStore::open(source.open().await?, Default::default()).await?;
            store.set(user, namespace, key, value, None, Some("conflict-test")).await?;
            Ok::<_, Failed>(())
        }
    };
    let target_value = || async {
        let backend = target.open().await?;
        Ok::<_, Failed>(backend.get(&victim).await?.map(|d| d.body))
    };
    set_at_source(json!("the source's second")).await?;

    // fail: the follow stops with exit 4, naming the document, and leaves it alone.
    let output = agentstore(dir)
        .args(follow_args(&source, &target, &["--until-caught-up", "--on-conflict", "fail"]))
        .output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    check(output.status.code() == Some(4) && said.contains(&victim), || {
        format!("--on-conflict fail: exit {:?}, output {said}", output.status.code())
    })?;
    check(target_value().await?.as_ref() == Some(&targets_own), || "the fail policy changed the target".into())?;

    // skip: it is left and reported in the follow issues.
    let report = run_until_caught_up(dir, &source, &target, &["--on-conflict", "skip"])?;
    let issues = report["follow"]["issues"].as_array().cloned().unwrap_or_default();
    check(issues.iter().any(|i| i["id"] == victim.as_str() && i["kind"] == "conflict_skipped"), || {
        format!("the skipped conflict is not reported: {}", report["follow"])
    })?;
    check(report["follow"]["counts"]["conflicts_skipped"] == 1, || format!("{}", report["follow"]["counts"]))?;
    check(target_value().await?.as_ref() == Some(&targets_own), || "the skip policy changed the target".into())?;

    // overwrite: the next change at the source replaces the target's document.
    set_at_source(json!("the source's third")).await?;
    let report = run_until_caught_up(dir, &source, &target, &["--on-conflict", "overwrite"])?;
    check(report["follow"]["counts"]["overwritten"] == 1, || format!("{}", report["follow"]["counts"]))?;
    let stored = target_value().await?.ok_or("the overwrite deleted the document")?;
    check(stored.get("value") == Some(&json!("the source's third")), || format!("after overwrite: {stored:?}"))?;
    verify_identical(dir, &source, &target)?;
    check_same_documents(&source, &target, &WriterSummary::default()).await
}
