//! The CouchDB API (`serve --couchdb-listen`) on every backend, checked over HTTP against what a
//! real CouchDB 3.4.3 answered (`fixtures/couchdb-3.4.3/`): statuses, error bodies exactly, the
//! fields and headers clients read, and the replication-peer rules. Real client libraries drive
//! the same endpoint in `tests/couchdb_clients.rs`.
//!
//! Each trial runs the API in process over a fresh store of one backend, on an ephemeral
//! loopback port. `AGENTSTORE_TEST_BACKENDS` selects backends as for the contract suite; a
//! selected backend whose server cannot be reached fails its trials.
//!
//! This module holds the trial list, the in-process endpoint and its answers, and the transcript
//! helpers; each topic file opens with what it covers.

mod all_docs;
mod attachments;
mod attachments_forwarded;
mod bulk;
mod changes;
mod consistency;
mod counts_across_instances;
mod crash_repairs;
mod data_store;
mod data_store_admin;
mod data_store_design;
mod data_store_engine;
mod data_store_feed;
mod data_store_routes;
mod databases;
mod db_updates;
mod dbs_info;
mod depth;
mod design_functions;
mod documents;
mod inner_bodies;
mod instances;
mod local_docs;
mod lockout;
mod logins;
mod mango;
mod missing_database;
mod node_endpoints;
mod paged_changes;
mod purge;
mod purge_between_polls;
mod purged_infos_limit;
mod replication;
mod replicator;
mod results_as_couchdb;
mod revision_trees;
mod revisions_and_refusals;
mod roles;
mod sequences;
mod server;
mod server_rules;
mod several_instances;
mod slow_readers;
mod users_db;
mod view_index_slots;
mod views;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use agentstore::config::{Overrides, Settings};
use agentstore::couchdb_api::{bind, CouchApp};
use agentstore::store::{DataStore, StoreOptions};
use libtest_mimic::{Arguments, Failed, Trial};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::common::harness;
use crate::common::{block_on, check, TestResult};

type TrialFn = fn(Endpoint) -> harness::BoxFuture<TestResult>;

const DB: &str = "agent_data_store";

/// The suite's trials, named `couchdb_api::CASE::BACKEND`; `None`, after printing why, when the
/// backend selection is invalid.
pub fn trials(args: &Arguments) -> Option<Vec<Trial>> {
    let (backends, selected) = harness::announce("couchdb api suite", args.list)?;
    let cases: Vec<(&str, TrialFn)> = vec![
        ("mango_over_http", |e| Box::pin(mango::mango_over_http(e))),
        ("mango_answers_as_couchdb", |e| Box::pin(mango::mango_answers_as_couchdb(e))),
        ("mango_json_indexes", |e| Box::pin(mango::mango_json_indexes(e))),
        ("per_user_logins", |e| Box::pin(logins::per_user_logins(e))),
        ("server_and_database", |e| Box::pin(server::server_and_database(e))),
        ("every_db_route_refuses_other_databases", |e| Box::pin(server::every_db_route_refuses_other_databases(e))),
        ("document_lifecycle", |e| Box::pin(documents::document_lifecycle(e))),
        ("deletion_fields", |e| Box::pin(documents::deletion_fields(e))),
        ("data_store_rules", |e| Box::pin(data_store::data_store_rules(e))),
        ("bulk_docs_and_bulk_get", |e| Box::pin(bulk::bulk_docs_and_bulk_get(e))),
        ("all_docs", |e| Box::pin(all_docs::all_docs(e))),
        ("changes_feeds", |e| Box::pin(changes::changes_feeds(e))),
        ("replication_peer", |e| Box::pin(replication::replication_peer(e))),
        ("data_store_conflicts", |e| Box::pin(replication::data_store_conflicts(e))),
        ("local_documents", |e| Box::pin(documents::local_documents(e))),
        ("gzip_and_chunked_bodies", |e| Box::pin(server::gzip_and_chunked_bodies(e))),
        ("design_documents", |e| Box::pin(documents::design_documents(e))),
        ("data_store_field_types", |e| Box::pin(data_store::data_store_field_types(e))),
        ("data_store_reads_as_stored", |e| Box::pin(data_store::data_store_reads_as_stored(e))),
        ("data_store_indexes_and_purge", |e| Box::pin(data_store::data_store_indexes_and_purge(e))),
        ("bulk_docs_whole_request_errors", |e| Box::pin(bulk::bulk_docs_whole_request_errors(e))),
        ("bulk_docs_all_or_nothing", |e| Box::pin(bulk::bulk_docs_all_or_nothing(e))),
        ("all_docs_keys_paging", |e| Box::pin(all_docs::all_docs_keys_paging(e))),
        ("deletions_as_couchdb", |e| Box::pin(documents::deletions_as_couchdb(e))),
        ("local_documents_unchecked", |e| Box::pin(documents::local_documents_unchecked(e))),
        ("revision_reads_as_couchdb", |e| Box::pin(documents::revision_reads_as_couchdb(e))),
        ("server_root_fields", |e| Box::pin(server::server_root_fields(e))),
        ("changes_since_and_limit", |e| Box::pin(changes::changes_since_and_limit(e))),
        ("changes_show_writes_at_once", |e| Box::pin(changes::changes_show_writes_at_once(e))),
        ("all_docs_from_the_empty_id", |e| Box::pin(all_docs::all_docs_from_the_empty_id(e))),
        ("all_docs_backend_failure_is_never_a_short_200", |e| Box::pin(all_docs::all_docs_backend_failure(e))),
        ("continuous_changes_list_each_write_once", |e| Box::pin(changes::continuous_changes_list_each_write_once(e))),
        ("databases_lifecycle", |e| Box::pin(databases::databases_lifecycle(e))),
        ("any_document_and_its_conflicts", |e| Box::pin(databases::any_document_and_its_conflicts(e))),
        ("bad_input_on_databases", |e| Box::pin(databases::bad_input_on_databases(e))),
        ("deleting_a_database_under_writers_and_a_feed", |e| {
            Box::pin(databases::deleting_a_database_under_writers_and_a_feed(e))
        }),
        ("server_probes", |e| Box::pin(databases::server_probes(e))),
        ("roles_and_security", |e| Box::pin(roles::roles_and_security(e))),
        ("local_docs_listings", |e| Box::pin(local_docs::local_docs_listings(e))),
        ("attachments_in_documents", |e| Box::pin(attachments::attachments_in_documents(e))),
        ("attachments_standalone", |e| Box::pin(attachments::attachments_standalone(e))),
        ("attachments_stored_once_and_freed", |e| Box::pin(attachments::attachments_stored_once_and_freed(e))),
        ("attachments_64_mib_round_trip", |e| Box::pin(attachments::attachments_64_mib_round_trip(e))),
        ("attachments_multipart_upload", |e| Box::pin(attachments::attachments_multipart_upload(e))),
        ("views_map_and_collation", |e| Box::pin(views::views_map_and_collation(e))),
        ("views_reduce", |e| Box::pin(views::views_reduce(e))),
        ("views_follow_changes", |e| Box::pin(views::views_follow_changes(e))),
        ("views_runaway_function", |e| Box::pin(views::views_runaway_function(e))),
        ("changes_filters", |e| Box::pin(views::changes_filters(e))),
        ("views_emit_order_and_attachments", |e| Box::pin(views::views_emit_order_and_attachments(e))),
        ("validate_doc_update", |e| Box::pin(views::validate_doc_update(e))),
        ("data_store_views", |e| Box::pin(views::data_store_views(e))),
        ("attachments_multipart_answers", |e| Box::pin(attachments::attachments_multipart_answers(e))),
        ("attachments_gzip_parts", |e| Box::pin(attachments::attachments_gzip_parts(e))),
        ("forwarded_ranges", |e| Box::pin(attachments_forwarded::forwarded_ranges(e))),
        ("forwarded_80_mib_round_trip", |e| Box::pin(attachments_forwarded::forwarded_80_mib_round_trip(e))),
        ("forwarded_attachment_bound", |e| Box::pin(attachments_forwarded::forwarded_attachment_bound(e))),
        ("interrupted_uploads_leave_nothing", |e| {
            Box::pin(attachments_forwarded::interrupted_uploads_leave_nothing(e))
        }),
        ("js_endless_thrown_values", |e| Box::pin(design_functions::js_endless_thrown_values(e))),
        ("js_databases_kept_apart", |e| Box::pin(design_functions::js_databases_kept_apart(e))),
        ("design_documents_must_compile", |e| Box::pin(design_functions::design_documents_must_compile(e))),
        ("changes_filter_past_its_time_bound", |e| Box::pin(design_functions::changes_filter_past_its_time_bound(e))),
        ("nesting_depth_on_databases", |e| Box::pin(depth::nesting_depth_on_databases(e))),
        ("nesting_depth_on_the_data_store", |e| Box::pin(depth::nesting_depth_on_the_data_store(e))),
        ("numbers_beyond_doubles", |e| Box::pin(depth::numbers_beyond_doubles(e))),
        ("slow_readers_hold_no_threads", |e| Box::pin(slow_readers::slow_readers_hold_no_threads(e))),
        ("admin_endpoints_names_and_headers", |e| Box::pin(server_rules::admin_endpoints_names_and_headers(e))),
        ("revs_diff_takes_replicator_sized_bodies", |e| {
            Box::pin(server_rules::revs_diff_takes_replicator_sized_bodies(e))
        }),
        ("per_user_counts_ignore_other_users", |e| Box::pin(server_rules::per_user_counts_ignore_other_users(e))),
        ("revisions_as_couchdb", |e| Box::pin(revisions_and_refusals::revisions_as_couchdb(e))),
        ("refused_writes_as_couchdb", |e| Box::pin(revisions_and_refusals::refused_writes_as_couchdb(e))),
        ("statuses_as_couchdb", |e| Box::pin(revisions_and_refusals::statuses_as_couchdb(e))),
        ("same_as_couchdb_changes_filtered_descending_limit", |e| {
            Box::pin(results_as_couchdb::changes_filtered_descending_limit(e))
        }),
        ("same_as_couchdb_design_docs_count_design_documents", |e| {
            Box::pin(results_as_couchdb::design_docs_count_design_documents(e))
        }),
        ("same_as_couchdb_copy_destination_as_couchdb", |e| {
            Box::pin(results_as_couchdb::copy_destination_as_couchdb(e))
        }),
        ("same_as_couchdb_empty_id_reads", |e| Box::pin(results_as_couchdb::empty_id_reads(e))),
        ("same_as_couchdb_local_documents_as_couchdb", |e| Box::pin(results_as_couchdb::local_documents_as_couchdb(e))),
        ("same_as_couchdb_bulk_docs_changes_in_id_order", |e| {
            Box::pin(results_as_couchdb::bulk_docs_changes_in_id_order(e))
        }),
        ("revision_tree_cost_follows_what_was_sent", |e| {
            Box::pin(revision_trees::revision_tree_cost_follows_what_was_sent(e))
        }),
        ("attachments_gzip_ratio_bound", |e| Box::pin(attachments::attachments_gzip_ratio_bound(e))),
        ("attachments_inline_budget", |e| Box::pin(attachments::attachments_inline_budget(e))),
        ("views_queries_streamed", |e| Box::pin(views::views_queries_streamed(e))),
        ("views_build_bounds", |e| Box::pin(views::views_build_bounds(e))),
        ("views_grouping_and_key_order", |e| Box::pin(views::views_grouping_and_key_order(e))),
        ("per_user_feed_positions_sealed", |e| Box::pin(server_rules::per_user_feed_positions_sealed(e))),
        ("purge_keeps_other_ids_history", |e| Box::pin(purge::purge_keeps_other_ids_history(e))),
        ("purge_leaves_ids_starting_with_it", |e| Box::pin(purge::purge_leaves_ids_starting_with_it(e))),
        ("listings_paged_by_bytes", |e| Box::pin(slow_readers::listings_paged_by_bytes(e))),
        ("views_queries_bound_is_a_setting", |e| Box::pin(views::views_queries_bound_is_a_setting(e))),
        ("attachments_inline_wait_is_a_setting", |e| Box::pin(attachments::attachments_inline_wait_is_a_setting(e))),
        ("data_store_tree_bound_is_the_setting", |e| Box::pin(revision_trees::data_store_tree_bound_is_the_setting(e))),
        ("a_deleted_database_is_404_everywhere", |e| {
            Box::pin(missing_database::a_deleted_database_is_404_everywhere(e))
        }),
        ("inner_bodies_kept_until_compaction", |e| Box::pin(inner_bodies::inner_bodies_kept_until_compaction(e))),
        ("inner_bodies_freed_by_stemming_and_bounds", |e| {
            Box::pin(inner_bodies::inner_bodies_freed_by_stemming_and_bounds(e))
        }),
        ("sequences_count_the_feed", |e| Box::pin(sequences::sequences_count_the_feed(e))),
        ("paged_changes_list_each_change_once", |e| Box::pin(paged_changes::paged_changes_list_each_change_once(e))),
        ("purge_between_polls_never_moves_n_back", |e| {
            Box::pin(purge_between_polls::purge_between_polls_never_moves_n_back(e))
        }),
        ("replicator_reads_repair_a_cut_create", |e| Box::pin(crash_repairs::replicator_reads_repair_a_cut_create(e))),
        ("listings_finish_a_cut_deletion", |e| Box::pin(crash_repairs::listings_finish_a_cut_deletion(e))),
        ("data_store_feed_confined_to_the_login", |e| {
            Box::pin(data_store_feed::data_store_feed_confined_to_the_login(e))
        }),
        ("data_store_feed_shows_every_leaf", |e| Box::pin(data_store_feed::data_store_feed_shows_every_leaf(e))),
        ("data_store_feed_wakes_on_facade_writes", |e| {
            Box::pin(data_store_feed::data_store_feed_wakes_on_facade_writes(e))
        }),
        ("data_store_design_documents_are_records", |e| {
            Box::pin(data_store_design::data_store_design_documents_are_records(e))
        }),
        ("data_store_per_user_confined_on_every_read", |e| {
            Box::pin(data_store_engine::per_user_confined_on_every_read(e))
        }),
        ("data_store_admin_replication_as_couchdb", |e| Box::pin(data_store_engine::admin_replication_as_couchdb(e))),
        ("data_store_rest_reads_what_couchdb_wrote", |e| Box::pin(data_store_engine::rest_reads_what_couchdb_wrote(e))),
        ("data_store_settings_by_login", |e| Box::pin(data_store_admin::data_store_settings_by_login(e))),
        ("data_store_purge_count_out_of_reach", |e| Box::pin(data_store_admin::data_store_purge_count_out_of_reach(e))),
        ("data_store_purge_by_admin", |e| Box::pin(data_store_admin::data_store_purge_by_admin(e))),
        ("a_feed_under_a_deletion_ends_never_500", |e| {
            Box::pin(missing_database::a_feed_under_a_deletion_ends_never_500(e))
        }),
        ("data_store_concurrent_edits_one_wins", |e| Box::pin(data_store_engine::concurrent_edits_one_wins(e))),
        ("data_store_edit_of_a_deleted_leaf", |e| Box::pin(data_store_engine::edit_of_a_deleted_leaf(e))),
        ("data_store_validate_doc_update", |e| Box::pin(data_store_design::data_store_validate_doc_update(e))),
        ("data_store_replicated_design_documents", |e| {
            Box::pin(data_store_design::data_store_replicated_design_documents(e))
        }),
        ("data_store_per_user_find_and_design_docs", |e| Box::pin(data_store_routes::per_user_find_and_design_docs(e))),
        ("data_store_per_user_create_and_delete_database", |e| {
            Box::pin(data_store_routes::per_user_create_and_delete_database(e))
        }),
        ("purged_infos_limit_as_couchdb", |e| Box::pin(purged_infos_limit::purged_infos_limit_as_couchdb(e))),
        ("get_dbs_info_as_couchdb", |e| Box::pin(dbs_info::get_dbs_info_as_couchdb(e))),
        ("views_servers_sharing_an_index_directory", |e| {
            Box::pin(view_index_slots::servers_sharing_an_index_directory(e))
        }),
        ("sessions_valid_on_every_instance", |e| Box::pin(instances::sessions_valid_on_every_instance(e))),
        ("lockout_counted_across_instances", |e| Box::pin(lockout::lockout_counted_across_instances(e))),
        ("lockout_behind_trusted_proxies", |e| Box::pin(lockout::lockout_behind_trusted_proxies(e))),
        ("instances_see_a_database_deleted_and_created_again", |e| {
            Box::pin(several_instances::deleted_and_created_again_on_another_instance(e))
        }),
        ("instances_see_purges_in_views_and_indexes", |e| {
            Box::pin(several_instances::purge_and_re_creation_reach_every_instance(e))
        }),
        ("instances_share_feeds_and_checkpoints", |e| {
            Box::pin(several_instances::feeds_and_checkpoints_across_instances(e))
        }),
        ("instances_agree_after_concurrent_writers", |e| {
            Box::pin(consistency::instances_agree_after_concurrent_writers(e))
        }),
        ("instances_count_each_other_s_writes_at_once", |e| {
            Box::pin(counts_across_instances::counts_follow_another_instance_at_once(e))
        }),
        ("instances_see_a_database_created_at_once", |e| {
            Box::pin(several_instances::created_on_one_instance_is_there_on_the_other_at_once(e))
        }),
        ("instances_apply_each_other_s_revs_limit_at_once", |e| {
            Box::pin(several_instances::revs_limit_set_on_one_instance_holds_at_once_on_the_other(e))
        }),
        ("users_db_logins", |e| Box::pin(users_db::users_db_logins(e))),
        ("users_db_couchdb_hash_moves_in", |e| Box::pin(users_db::users_db_couchdb_hash_moves_in(e))),
        ("db_updates_as_couchdb", |e| Box::pin(db_updates::db_updates_as_couchdb(e))),
        ("db_updates_longpoll_woken_by_a_create", |e| Box::pin(db_updates::db_updates_longpoll_woken_by_a_create(e))),
        ("db_updates_continuous_heartbeat", |e| Box::pin(db_updates::db_updates_continuous_heartbeat(e))),
        ("instances_see_each_other_s_db_updates", |e| Box::pin(db_updates::db_updates_across_instances(e))),
        ("node_endpoints_as_couchdb", |e| Box::pin(node_endpoints::node_endpoints_as_couchdb(e))),
        ("replicator_one_shot_as_couchdb", |e| Box::pin(replicator::replicator_one_shot_as_couchdb(e))),
        ("replicator_continuous_and_filtered", |e| Box::pin(replicator::replicator_continuous_and_filtered(e))),
        ("replicate_endpoint_as_couchdb", |e| Box::pin(replicator::replicate_endpoint_as_couchdb(e))),
        ("replicator_one_instance_per_job", |e| Box::pin(replicator::replicator_one_instance_per_job(e))),
        ("replicator_owner_and_logins", |e| Box::pin(replicator::replicator_owner_and_logins(e))),
    ];
    let mut trials = Vec::new();
    for backend in &backends {
        for &(name, case) in &cases {
            let fresh = backend.fresh;
            let backend_name = backend.name;
            trials.push(
                Trial::test(format!("couchdb_api::{name}::{backend_name}"), move || {
                    run_trial(name, async move {
                        let logins = match name {
                            "per_user_logins"
                            | "local_docs_listings"
                            | "data_store_indexes_and_purge"
                            | "admin_endpoints_names_and_headers"
                            | "per_user_counts_ignore_other_users"
                            | "per_user_feed_positions_sealed"
                            | "data_store_feed_confined_to_the_login"
                            | "sessions_valid_on_every_instance" => Some(logins::logins_config()?),
                            "data_store_per_user_confined_on_every_read"
                            | "data_store_per_user_find_and_design_docs"
                            | "data_store_per_user_create_and_delete_database" => Some(logins::logins_config()?),
                            "data_store_settings_by_login" | "data_store_purge_count_out_of_reach" => {
                                Some(data_store_admin::admin_logins_config()?)
                            }
                            "roles_and_security" | "replicator_owner_and_logins" => Some(roles::roles_config()?),
                            "users_db_logins" | "users_db_couchdb_hash_moves_in" => Some(users_db::config()?),
                            "attachments_in_documents" | "attachments_gzip_parts" => {
                                Some(attachments::BOUNDED_CONFIG.to_owned())
                            }
                            "attachments_stored_once_and_freed" => Some(attachments::FREE_AT_ONCE_CONFIG.to_owned()),
                            "forwarded_attachment_bound" => Some(attachments_forwarded::BOUNDED_CONFIG.to_owned()),
                            "views_runaway_function" => Some(views::JS_BOUNDS_CONFIG.to_owned()),
                            "js_endless_thrown_values" | "changes_filter_past_its_time_bound" => {
                                Some(design_functions::TWO_WORKERS_CONFIG.to_owned())
                            }
                            "js_databases_kept_apart" => Some(design_functions::ONE_WORKER_CONFIG.to_owned()),
                            "revision_tree_cost_follows_what_was_sent" => {
                                Some(revision_trees::TREE_BOUND_CONFIG.to_owned())
                            }
                            "attachments_inline_budget" => Some(attachments::INLINE_BUDGET_CONFIG.to_owned()),
                            "views_build_bounds" => Some(views::BUILD_BOUNDS_CONFIG.to_owned()),
                            "views_queries_bound_is_a_setting" => Some(views::VIEW_QUERIES_CONFIG.to_owned()),
                            "attachments_inline_wait_is_a_setting" => Some(attachments::INLINE_WAIT_CONFIG.to_owned()),
                            "data_store_tree_bound_is_the_setting" => {
                                Some(revision_trees::SMALL_TREE_BOUND_CONFIG.to_owned())
                            }
                            "inner_bodies_kept_until_compaction" => Some(attachments::FREE_AT_ONCE_CONFIG.to_owned()),
                            "inner_bodies_freed_by_stemming_and_bounds" => {
                                Some(inner_bodies::INNER_BODIES_BOUND_CONFIG.to_owned())
                            }
                            "purged_infos_limit_as_couchdb" => Some(purged_infos_limit::config()?),
                            "get_dbs_info_as_couchdb" => Some(dbs_info::DBS_INFO_CONFIG.to_owned()),
                            "lockout_counted_across_instances" => Some(logins::logins_config()?),
                            "lockout_behind_trusted_proxies" => Some(lockout::trusted_loopback_config()?),
                            "db_updates_as_couchdb"
                            | "db_updates_longpoll_woken_by_a_create"
                            | "db_updates_continuous_heartbeat"
                            | "instances_see_each_other_s_db_updates" => Some(db_updates::config()?),
                            "node_endpoints_as_couchdb" => Some(node_endpoints::config()?),
                            _ => None,
                        };
                        let endpoint = Endpoint::start(fresh, backend_name, logins).await?;
                        case(endpoint).await
                    })
                })
                .with_ignored_flag(!selected.contains(&backend.name)),
            );
        }
    }
    Some(trials)
}

/// Runs a trial on the suite's runtime; the slow readers' trial on one with a small blocking
/// pool ([`slow_readers::SLOW_READER_POOL`]), which an answer holding a thread would exhaust.
fn run_trial(name: &str, trial: impl std::future::Future<Output = TestResult>) -> TestResult {
    if name != "slow_readers_hold_no_threads" {
        return block_on(trial);
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(slow_readers::SLOW_READER_POOL)
        .enable_all()
        .build()
        .map_err(|e| Failed::from(format!("tokio runtime: {e}")))?
        .block_on(trial)
}

/// A second server over an [`Endpoint`]'s store ([`Endpoint::beside`]), serving until dropped.
struct Beside {
    root: String,
    client: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
    /// Its configuration and view indexes, when it has its own ([`Endpoint::beside_with`]).
    _config_dir: Option<tempfile::TempDir>,
}

impl Beside {
    async fn put(&self, path: &str, body: Value) -> Result<Answer, Failed> {
        Answer::read(self.client.put(format!("{}{path}", self.root)).json(&body).send().await?).await
    }
}

/// The API over one fresh backend, serving until dropped.
struct Endpoint {
    root: String,
    backend: &'static str,
    client: reqwest::Client,
    /// The databases besides the data-store one, to look at their storage.
    databases: Arc<agentstore::database::Databases>,
    _ctx: harness::Ctx,
    _config_dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Endpoint {
    /// The API over a fresh store of `backend`; `config` is a TOML configuration (logins), if any.
    async fn start(
        fresh: fn() -> harness::BoxFuture<Result<harness::Ctx, String>>,
        backend: &'static str,
        config: Option<String>,
    ) -> Result<Self, Failed> {
        let ctx = fresh().await.map_err(|e| Failed::from(format!("{backend} unavailable: {e}")))?;
        let config_dir = tempfile::tempdir()?;
        let config_file = config_dir.path().join("agentstore.toml");
        // Each endpoint's view indexes in a directory of its own (the file is locked while open).
        let views = config_dir.path().join("views");
        let config =
            format!("couchdb_view_index_dir = {:?}\n{}\n", views.display().to_string(), config.unwrap_or_default());
        std::fs::write(&config_file, config)?;
        let settings =
            Settings::load(Some(&config_file), &Overrides::default()).map_err(|e| Failed::from(e.to_string()))?;
        // Every backend with its default settings: a write shows in `_changes` at once, settle
        // window or not (issue 22), so no trial waits one out. The store's options are the
        // trial's configuration (`couchdb_max_tree_bytes` bounds the data-store database too).
        let store = Arc::new(DataStore::open(Arc::clone(&ctx.backend), settings.store_options()).await?);
        let app = CouchApp::build(store, &settings).await?;
        let databases = app.databases();
        let listener = bind("127.0.0.1:0", &app, false).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = app
                .serve(listener, &settings, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Endpoint {
            root: format!("http://{addr}"),
            backend,
            client: reqwest::Client::new(),
            databases,
            _ctx: ctx,
            _config_dir: config_dir,
            _stop: stop,
        })
    }

    /// A second server over this endpoint's store (another process, as far as the engine knows:
    /// its own facade, write queues and databases), serving until dropped.
    async fn beside(&self) -> Result<Beside, Failed> {
        let settings = Settings::load(None, &Overrides::default()).map_err(|e| Failed::from(e.to_string()))?;
        self.serve_beside(settings, None).await
    }

    /// [`Endpoint::beside`] with this endpoint's configuration (the same logins and password
    /// hashes), its view indexes its own.
    async fn beside_configured(&self) -> Result<Beside, Failed> {
        let config_dir = tempfile::tempdir()?;
        let config_file = config_dir.path().join("agentstore.toml");
        let ours = std::fs::read_to_string(self._config_dir.path().join("agentstore.toml"))?;
        // Its own view index directory, whatever this endpoint's configuration says of one: first,
        // as a top-level key (after a `[[couchdb_users]]` table it would be one of that table's).
        let own_dir = format!("couchdb_view_index_dir = {:?}\n", config_dir.path().join("views").display().to_string());
        let kept = ours.lines().filter(|line| !line.trim_start().starts_with("couchdb_view_index_dir"));
        let config: String = std::iter::once(own_dir).chain(kept.map(|line| format!("{line}\n"))).collect();
        std::fs::write(&config_file, config)?;
        let settings =
            Settings::load(Some(&config_file), &Overrides::default()).map_err(|e| Failed::from(e.to_string()))?;
        self.serve_beside(settings, Some(config_dir)).await
    }

    async fn serve_beside(&self, settings: Settings, config_dir: Option<tempfile::TempDir>) -> Result<Beside, Failed> {
        let store = Arc::new(DataStore::open(Arc::clone(&self._ctx.backend), settings.store_options()).await?);
        let app = CouchApp::build(store, &settings).await?;
        let listener = bind("127.0.0.1:0", &app, false).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = app
                .serve(listener, &settings, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Beside {
            root: format!("http://{addr}"),
            client: reqwest::Client::new(),
            _stop: stop,
            _config_dir: config_dir,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.root)
    }

    /// Sends a request; answers status, headers and the JSON body (`Null` when empty).
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Result<Answer, Failed> {
        let mut request = self.client.request(method, self.url(path)).header("Accept", "application/json");
        if let Some(body) = body {
            request = request.json(&body);
        }
        Answer::read(request.send().await?).await
    }

    async fn get(&self, path: &str) -> Result<Answer, Failed> {
        self.call(Method::GET, path, None).await
    }
    async fn put(&self, path: &str, body: Value) -> Result<Answer, Failed> {
        self.call(Method::PUT, path, Some(body)).await
    }
    async fn post(&self, path: &str, body: Value) -> Result<Answer, Failed> {
        self.call(Method::POST, path, Some(body)).await
    }
    async fn delete(&self, path: &str) -> Result<Answer, Failed> {
        self.call(Method::DELETE, path, None).await
    }
}

struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Answer {
    async fn read(response: reqwest::Response) -> Result<Self, Failed> {
        let status = response.status();
        let headers = response.headers().clone();
        let text = response.text().await?;
        let body = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).map_err(|e| format!("{status}: body is not JSON ({e}): {text:.300}"))?
        };
        Ok(Answer { status, headers, body })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The status must be `status`, and every response is JSON by its header.
    fn expect(self, status: u16, what: &str) -> Result<Self, Failed> {
        if self.header("content-type").is_none_or(|t| !t.starts_with("application/json")) {
            return Err(
                format!("{what}: Content-Type is {:?}, not application/json", self.header("content-type")).into()
            );
        }
        if self.status.as_u16() != status {
            return Err(format!("{what}: status {} (wanted {status}), body {}", self.status, self.body).into());
        }
        Ok(self)
    }

    fn rev(&self) -> Result<String, Failed> {
        self.body["rev"].as_str().map(str::to_owned).ok_or_else(|| format!("no rev in {}", self.body).into())
    }
}

/// A database of its own for one trial, named `{prefix}-{tag}-{random}` (the CouchDB backend's
/// server is shared by trials).
async fn fresh_db_named(e: &Endpoint, prefix: &str, tag: &str) -> Result<String, Failed> {
    let mut random = [0u8; 6];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    let name = format!("{prefix}-{tag}-{}", hex::encode(random));
    e.call(Method::PUT, &format!("/{name}"), None).await?.expect(201, "PUT database")?;
    Ok(name)
}

/// Whether the trial's backend is the CouchDB one over pouchdb-server (CI's stand-in), whose
/// answers differ from Apache CouchDB 3.4.3's in places (`/work/shared/TEST-SERVERS.md`' table).
fn on_pouchdb_server(e: &Endpoint) -> bool {
    e.backend == "couchdb"
        && crate::common::servers::couchdb().is_ok_and(|server| server.product.starts_with("pouchdb-server"))
}

/// Runs `steps` between two drops of the databases `names` (a missing one is fine): on the CouchDB
/// backend the server is shared by every run, so a trial that names its databases leaves none
/// behind for the next run to meet (`412 file_exists`), even when it failed half way.
async fn with_databases_dropped(
    e: &Endpoint,
    names: &[&str],
    steps: impl std::future::Future<Output = TestResult>,
) -> TestResult {
    drop_databases(e, names).await?;
    let outcome = steps.await;
    drop_databases(e, names).await?;
    outcome
}

async fn drop_databases(e: &Endpoint, names: &[&str]) -> TestResult {
    for name in names {
        let answer = e.delete(&format!("/{name}")).await?;
        check(matches!(answer.status.as_u16(), 200 | 202 | 404), || {
            format!("DELETE /{name}: {} {}", answer.status, answer.body)
        })?;
    }
    Ok(())
}

/// A transcript of the real CouchDB 3.4.3.
fn fixture(name: &str) -> Value {
    let path = format!("{}/fixtures/couchdb-3.4.3/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The body CouchDB answered in a transcript.
fn couchdb_body(name: &str) -> Value {
    fixture(name)["response"]["body"].clone()
}

/// An error answer must be CouchDB's, exactly.
fn same_error(answer: &Answer, transcript: &str) -> TestResult {
    let expected = fixture(transcript);
    check(answer.status.as_u16() as u64 == expected["response"]["status"].as_u64().unwrap_or(0), || {
        format!("{transcript}: status {} where CouchDB answered {}", answer.status, expected["response"]["status"])
    })?;
    check(answer.body == expected["response"]["body"], || {
        format!("{transcript}: body {} where CouchDB answered {}", answer.body, expected["response"]["body"])
    })
}

/// The same key set as CouchDB's answer (values differ: revisions, uuids, counts).
fn same_fields(actual: &Value, expected: &Value, what: &str, allowed_missing: &[&str]) -> TestResult {
    let keys = |v: &Value| {
        v.as_object().map(|m| m.keys().cloned().collect::<std::collections::BTreeSet<_>>()).unwrap_or_default()
    };
    let (have, want) = (keys(actual), keys(expected));
    let missing: Vec<_> = want.difference(&have).filter(|k| !allowed_missing.contains(&k.as_str())).collect();
    check(missing.is_empty(), || format!("{what}: fields {missing:?} that CouchDB gives are missing from {actual}"))
}

fn doc(user: &str, namespace: &str, key: &str, value: Value) -> Value {
    let id = agentstore::model::DocumentId::new(user, namespace, key, &Default::default()).expect("valid id");
    json!({ "_id": id.as_str(), "userId": user, "namespace": namespace, "key": key, "value": value })
}

fn path_of(id: &str) -> String {
    format!("/{DB}/{}", percent_encoding::utf8_percent_encode(id, percent_encoding::NON_ALPHANUMERIC))
}
