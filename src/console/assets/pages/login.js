// Log in with a CouchDB login: `POST /_session` sets the session cookie every later call
// carries; `GET /_session` then says who the page acts for.
import { post } from '../api.js';
import { h, fill, field, message, errorText } from '../ui.js';
import { refreshSession } from '../app.js';

export async function render(main, { params }) {
  const name = h('input', { id: 'login-name', name: 'name', autocomplete: 'username', required: true });
  const password = h('input', { id: 'login-password', name: 'password', type: 'password', autocomplete: 'current-password', required: true });
  const outcome = h('div', { 'aria-live': 'polite' });
  const form = h('form', { class: 'stack', id: 'login-form', onsubmit: submit },
    field('Name', name), field('Password', password), h('div', { class: 'actions' }, h('button', { type: 'submit', id: 'login-submit' }, 'Log in')));
  fill(main, h('h1', {}, 'Log in'),
    h('section', {}, h('p', { class: 'muted' }, 'A CouchDB login of this service (a server admin, a data-store user, or a user of _users). The console then shows what CouchDB would show that login.'), form, outcome));
  name.focus();

  async function submit(event) {
    event.preventDefault();
    try {
      await post('/_session', { name: name.value, password: password.value });
      await refreshSession();
      location.hash = params.get('next') || '#/databases';
    } catch (err) {
      fill(outcome, message('error', err.status === 401 ? 'Name or password is incorrect (401).' : errorText(err)));
      password.select();
    }
  }
}
